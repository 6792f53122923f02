""" The roofline model of a GPU step (scripts/gpu_model.py), run at a small size so that it cannot rot: what it traces
and counts (bytes, FLOPs, launches, CUDA's autocast), what it predicts for the Triton path against the torch path,
and the JSON it writes. Its figures at the real sizes are in docs/performance.md (predicted, never measured)."""
import importlib.util
import json

import pytest
import torch
from conftest import SCRIPTS

from timm_affinediv._torch_compat import FakeTensorMode


@pytest.fixture(scope='module')
def gpu_model():
    spec = importlib.util.spec_from_file_location('gpu_model', SCRIPTS / 'gpu_model.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope='module')
def steps(gpu_model):
    """One train step of resnet50 at 32 px, batch 2, channels-last: native, patchnorm's Triton path and its torch
    path, traced once for the module (about 10 s)."""
    traced = {}
    for norm, path in gpu_model.VARIANTS:
        step = gpu_model.Step('resnet50', norm, path, 'train', 2, 32, 'channels_last')
        traced[step.label] = (step, gpu_model.trace(step))
    return traced


def test_a_convolution_is_priced_by_its_formula(gpu_model):
    with FakeTensorMode():
        x = torch.empty(2, 8, 16, 16, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
        weight = torch.empty(16, 8, 3, 3, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
        y = torch.ops.aten.convolution(x, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        [launch] = gpu_model.aten_launches(torch.ops.aten.convolution.default,
                                           (x, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {}, y)
        nchw = x.contiguous()
        transposed = gpu_model.aten_launches(torch.ops.aten.convolution.default,
                                             (nchw, weight.contiguous(), None, [1, 1], [1, 1], [1, 1], False, [0, 0],
                                              1), {}, torch.empty(2, 16, 16, 16, dtype=torch.bfloat16))
    assert launch.flops == 2 * 2 * 16 * 16 * 16 * (8 * 3 * 3)
    assert (launch.read, launch.written) == ((2 * 8 * 16 * 16 + 16 * 8 * 9) * 2, 2 * 16 * 16 * 16 * 2)
    assert launch.engine == 'gemm'
    # cuDNN transposes NCHW activations for its tensor-core kernels: the input and the output, each read and written
    assert [t.op for t in transposed] == ['convolution', 'nchw_to_nhwc', 'nchw_to_nhwc']


def test_each_operation_has_one_cost_rule(gpu_model):
    """The name sets the rules are built from share no name (one would silently take another's rule), and a name
    finds its rule by name, then by prefix, then as a reduction or an elementwise kernel."""
    sets = [gpu_model.FREE, gpu_model.FILLS, gpu_model.GEMMS, gpu_model.POOLS, gpu_model.REDUCTIONS,
            {'native_batch_norm', 'native_batch_norm_backward', 'native_layer_norm', 'native_layer_norm_backward',
             'convolution', 'convolution_backward'}]
    assert sum(map(len, sets)) == len(set().union(*sets)) == len(gpu_model.RULES)
    rule = gpu_model.cost_rule
    assert rule('native_batch_norm') is gpu_model._batch_norm and rule('view') is gpu_model._free
    assert rule('_foreach_mul_') is gpu_model._foreach and rule('mm') is gpu_model._gemm
    assert rule('_scaled_dot_product_flash_attention_for_cpu_backward') is gpu_model._flash_attention
    assert rule('_softmax_backward_data') is rule('_new_backward_data') is gpu_model._reduction
    assert rule('mul') is rule('add_') is gpu_model._elementwise


def test_the_calibration_reads_the_measurements_in_the_repository(gpu_model):
    """The H200 steps come from the data folder (with its README saying how they were taken): the median of each
    configuration's timed rounds, channels-last first."""
    assert (gpu_model.H200_DATA / 'README.md').is_file()
    measured = gpu_model.measured_steps()
    assert list(measured)[:2] == [('resnet50', 'train', 'channels_last'), ('resnet50', 'inference', 'channels_last')]
    assert len(measured) == 7 and {layout for _, _, layout in measured} == {'channels_last', 'nchw'}
    native, patchnorm = measured[('resnet50', 'train', 'channels_last')]
    assert native == pytest.approx(0.029566, abs=1e-6) and patchnorm / native == pytest.approx(3.153, abs=1e-3)


def test_bytes_of_views_broadcasts_and_strided_reads(gpu_model):
    with FakeTensorMode():
        x = torch.empty(4, 8, 6, 6)
        assert gpu_model.dram_bytes(x) == 4 * 8 * 36 * 4
        assert gpu_model.dram_bytes(torch.empty(8)[None, :, None, None].expand(4, 8, 6, 6)) == 8 * 4
        # every other element of rows: whole 32-byte sectors, twice the elements' bytes for float32
        assert gpu_model.dram_bytes(x[:, :, :, ::2]) == 4 * 8 * 6 * 3 * 4 * 2


def test_autocast_follows_cuda_not_the_cpu(gpu_model):
    """Under `CudaAutocast` a CPU trace casts as CUDA does: LayerNorm and sums in float32 (the CPU keeps bfloat16),
    convolutions in bfloat16, and every operator of the policy has a CUDA autocast kernel in this build."""
    with gpu_model.CudaAutocast(), torch.autocast('cpu', dtype=torch.bfloat16):
        x = torch.randn(2, 4, 8, 8, dtype=torch.bfloat16)
        assert torch.nn.functional.layer_norm(x, (8,)).dtype == torch.float32
        assert x.sum().dtype == torch.float32 and torch.linalg.vector_norm(x, dim=1).dtype == torch.float32
        assert torch.nn.functional.conv2d(x.float(), torch.randn(3, 4, 1, 1)).dtype == torch.bfloat16
    with torch.autocast('cpu', dtype=torch.bfloat16):  # left: the CPU's own rules again
        assert torch.nn.functional.layer_norm(x, (8,)).dtype == torch.bfloat16
    cuda = set(gpu_model.autocast_ops('AutocastCUDA'))
    policy = {name for names in gpu_model.CUDA_AUTOCAST.values() for name in names}
    assert policy <= cuda, sorted(policy - cuda)


def test_a_train_step_native_against_both_patchnorm_paths(gpu_model, steps):
    native_step, native = steps['native']
    _, triton_path = steps['patchnorm (triton)']
    _, torch_path = steps['patchnorm (torch)']
    params = sum(p.numel() * p.element_size() for p in __import__('timm').create_model('resnet50').parameters())
    moved = lambda launches: sum(launch.bytes for launch in launches)  # noqa: E731
    # the optimizer alone reads and writes every parameter, its gradient and its momentum
    assert moved(native) > 3 * params
    assert sum(launch.bytes for launch in native if launch.phase == 'optimizer') >= 4 * params
    # every layer kind and phase is there; BatchNorm's passes in the native step, the Triton kernels only on that path
    assert {'forward', 'backward', 'optimizer'} == {launch.phase for launch in native}
    assert {'native_batch_norm:statistics', 'native_batch_norm_backward:reduce'} <= {launch.op for launch in native}
    assert {launch.op for launch in triton_path if launch.engine == 'triton'} == {
        '_channel_sq_norm_kernel', '_scale_kernel', '_scale_backward_kernel', '_box_filter_kernel'}  # the stem's rows
    assert not any(launch.engine == 'triton' for launch in torch_path)
    # the fused kernels move fewer bytes, in fewer launches, than the torch path's operations
    assert moved(triton_path) < moved(torch_path)
    assert sum(launch.count for launch in triton_path) < sum(launch.count for launch in torch_path) / 2
    # the Triton path runs the native model's convolutions; the torch path runs its wide 1x1 maps as matrix products
    flops = lambda launches: sum(launch.flops for launch in launches)  # noqa: E731
    assert flops(native) == flops(triton_path) > 0 and flops(torch_path) >= flops(native)
    for gpu in gpu_model.GPUS:
        p = gpu_model.predict(native_step, native, gpu)
        assert p.gpu_s == pytest.approx(sum(p.by_kind.values())) == pytest.approx(sum(p.by_phase.values()))
        assert p.seconds >= p.gpu_s > len(native) * gpu_model.FLOOR_S


def test_the_h100_is_slower_where_memory_bound(gpu_model, steps):
    step, launches = steps['patchnorm (triton)']
    h100, h200 = (gpu_model.predict(step, launches, gpu).gpu_s for gpu in ('h100', 'h200'))
    assert h200 < h100 < h200 * 4.8 / 3.35 + 1e-9


def test_the_command_prints_predictions_and_writes_json(run_script, tmp_path):
    out = tmp_path / 'model.json'
    done = run_script('gpu_model', '--models', 'resnet18', '--gpus', 'h200', '--layouts', 'nchw', '--modes',
                      'inference', '--batch-infer', '2', '--img-size', '32', '--json', str(out), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert '**Predicted** step time' in done.stdout and '| resnet18 | inference | nchw | H200 SXM |' in done.stdout
    written = json.loads(out.read_text())
    assert {p['variant'] for p in written['predictions']} == {'native', 'patchnorm (triton)', 'patchnorm (torch)'}
    assert all(p['predicted_ms'] > 0 and p['gpu'] == 'h200' for p in written['predictions'])
    assert written['parameters']['gpus']['h200']['bandwidth'] == 4.8e12
    bad = run_script('gpu_model', '--gpus', 'a100', timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith(
        'scripts/gpu_model.py: error: --gpus takes a comma-separated list of h100, h200')
