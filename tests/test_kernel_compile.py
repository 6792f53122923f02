""" The Triton kernels compiled for real GPUs, without one (scripts/kernel_registers.py)

Every kernel specialisation that train steps of patchnorm resnet50, convnext_tiny and vit_small launch (bfloat16
autocast and float32, channels-last and NCHW, 224 px; recorded under FakeTensorMode, specialised by Triton's own
JIT binder) is compiled ahead of time for sm_80 (A100) and sm_90a (H100/H200) by `triton.compile` with the `ptxas` in
Triton's wheel: each must compile, not spill, and stay within 128 registers per thread at its launch's warps (four
blocks of 128 threads an SM, for kernels whose speed is their memory traffic). 85 s on 2 shared cores with an empty
Triton cache (`~/.triton/cache`), about 50 s when it holds the kernels.
"""
import importlib.util
import json
import os
from pathlib import Path

import pytest


def _skip_reason() -> str:
    if importlib.util.find_spec('triton') is None:
        return 'Triton is not installed'
    tools = Path(importlib.util.find_spec('triton').origin).parent / 'backends' / 'nvidia' / 'bin'
    missing = [name for name in ('ptxas', 'cuobjdump') if not (tools / name).exists()]
    if missing:
        return f"Triton's wheel has no {' or '.join(missing)} in {tools}"
    return ''


@pytest.mark.skipif(bool(_skip_reason()), reason=_skip_reason())
def test_every_train_step_kernel_compiles_for_sm80_and_sm90a_within_128_registers(run_script, tmp_path):
    out = tmp_path / 'rows.json'
    env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}  # interpreted functions do not compile
    done = run_script('kernel_registers', '--json', str(out), '--budget', '128', env=env, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = json.loads(out.read_text())['rows']
    # the recording saw what a train step launches: every kernel, on both targets, in both dtypes and layouts
    assert {(r['kernel'], r['arch']) for r in rows} == {
        (k, a) for k in ('_channel_sq_norm_kernel', '_scale_kernel', '_scale_backward_kernel', '_box_filter_kernel')
        for a in ('sm_80', 'sm_90a')}
    assert {r['constants'].get('FLAT') for r in rows} == {True, False}
    assert {'*bf16', '*fp32'} <= {t for r in rows for t in r['pointers']}
    assert {r['constants']['GROUPED'] for r in rows
            if r['kernel'] in ('_channel_sq_norm_kernel', '_scale_backward_kernel')} == {True, False}
    # a grouped backward carries `t` over its channel blocks (channels-last), or its partial sums over its blocks of
    # positions (NCHW)
    assert {r['constants']['UNITS_OUTER'] for r in rows
            if r['kernel'] == '_scale_backward_kernel' and r['constants']['GROUPED']} == {True, False}
    # the output passes with the box filter inside: none, a k x k map's (of channel sums, of a depthwise input's
    # squares), and its adjoint
    scale = [r['constants'] for r in rows if r['kernel'] == '_scale_kernel']
    assert {c['BOX'] for c in scale} == {0, 1, 2}
    # a depthwise map's squares of `x` summed in the first pass of its two-pass window (ConvNeXt's 7 x 7), forward and
    # adjoint
    box_filter = [r['constants'] for r in rows if r['kernel'] == '_box_filter_kernel']
    assert {c['SQUARE'] for c in box_filter} == {True, False} and {c['ADJOINT'] for c in box_filter} == {True, False}
    # the `dx` passes that sum the backward's partial sums in their launch, after a k x k map and a 1x1 one
    assert {c['BOX'] for c in scale if c['SUM']} == {0, 2}
    # a one-channel map's window once a position; ConvNeXt's 7 x 7 windows in two passes (rows, then columns)
    assert {c['ONE_GROUP'] for c in scale if c['BOX']} == {True, False}
    assert {(c['KH'], c['KW']) for c in scale if c['BOX'] and not c['ONE_GROUP']} >= {(7, 1), (1, 7)}
    assert sum(r['launches'] for r in rows if r['arch'] == 'sm_90a') > 1500
    bad = [r for r in rows if r['error'] or r['local'] or r['registers'] > 128]
    assert not bad, bad
    print(done.stdout.strip().splitlines()[-3:])
