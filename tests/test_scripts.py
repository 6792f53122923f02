"""The developer scripts (scripts/*.py: benchmarks, measurements, the paper experiments) run from the source tree
against the installed package; each answers --help with its defaults and an example. Their real runs are tested
beside the features they measure (test_cli, test_evidence)."""
import pytest
from conftest import SCRIPTS

SCRIPT_NAMES = ('bench', 'bench_train', 'bench_onnx', 'bench_convert', 'bench_gpu', 'measure_conversion',
                'measure_finetune', 'measure_family_conversion', 'compare_train_py', 'coverage', 'experiments',
                'kernel_registers', 'launch_count', 'gpu_model')


def test_every_script_is_listed():
    assert sorted(p.stem for p in SCRIPTS.glob('*.py')) == sorted(SCRIPT_NAMES)


@pytest.mark.parametrize('name', SCRIPT_NAMES)
def test_help_of_every_script_names_defaults_and_an_example(name, run_script):
    proc = run_script(name, '--help', timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f'usage: scripts/{name}.py ')
    assert '(default: ' in proc.stdout and f'    python scripts/{name}.py ' in proc.stdout, proc.stdout


def test_bad_input_is_one_line_without_traceback(run_script):
    proc = run_script('bench', '--reps', '2', timeout=120)
    assert proc.returncode == 2 and 'Traceback' not in proc.stderr
    assert proc.stderr.strip() == ('scripts/bench.py: error: --reps 2: quartiles of the per-round ratios need at '
                                   'least 4 rounds (see --help)')
