"""The developer scripts (scripts/*.py: benchmarks, measurements, the paper experiments) run from the source tree
against the installed package; each answers --help with its defaults and an example. Their real runs are tested
beside the features they measure (test_cli, test_evidence)."""
import json
import subprocess
import sys

import pytest
from conftest import SCRIPTS

SCRIPT_NAMES = ('bench', 'bench_train', 'bench_onnx', 'bench_convert', 'bench_gpu', 'measure_conversion',
                'measure_finetune', 'measure_family_conversion', 'compare_train_py', 'coverage', 'experiments',
                'kernel_registers', 'launch_count', 'gpu_model', 'measure_family_recovery', 'measure_recovery_swap',
                'signal_propagation', 'measure_init_levers', 'tune_longer_budget')


def test_every_script_is_listed():
    assert sorted(p.stem for p in SCRIPTS.glob('*.py')) == sorted(SCRIPT_NAMES)


# Each script run as a file (`__main__`) with --help, all in one fresh process: the imports a script's start costs
# (torch, timm) are paid once, not once a script
_HELP_OF_EACH = """
import contextlib, io, json, runpy, sys
folder, helps = sys.argv[1], {}
sys.path.insert(0, folder)  # as `python scripts/NAME.py` puts it: the scripts import their siblings
for name in sys.argv[2:]:
    sys.argv, out, status = [f'{folder}/{name}.py', '--help'], io.StringIO(), None
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(sys.argv[0], run_name='__main__')
        except SystemExit as exit:
            status = exit.code
    helps[name] = [status, out.getvalue()]
print(json.dumps(helps))
"""


@pytest.fixture(scope='module')
def helps():
    proc = subprocess.run([sys.executable, '-c', _HELP_OF_EACH, str(SCRIPTS), *SCRIPT_NAMES], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize('name', SCRIPT_NAMES)
def test_help_of_every_script_names_defaults_and_an_example(name, helps):
    status, text = helps[name]
    assert status in (0, None), text
    assert text.startswith(f'usage: scripts/{name}.py ')
    assert '(default: ' in text and f'    python scripts/{name}.py ' in text, text


def test_bad_input_is_one_line_without_traceback(run_script):
    proc = run_script('bench', '--reps', '2', timeout=120)
    assert proc.returncode == 2 and 'Traceback' not in proc.stderr
    assert proc.stderr.strip() == ('scripts/bench.py: error: --reps 2: quartiles of the per-round ratios need at '
                                   'least 4 rounds (see --help)')

