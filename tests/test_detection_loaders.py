"`tools/detection_loaders.py`: both loaders build from one DataBlock and run on the CPU backend; the table names them"
from helpers import load_tool

dl = load_tool('detection_loaders')


def test_both_loaders_run_and_the_ratio_is_printed(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path))  # the scenes are written into this test's folder
    res = dl.main(['--device', 'cpu', '--size', '32', '--bs', '4', '--batches', '1', '--warmup', '1', '--passes', '1',
                   '--workers', '0', '--n-train', '8'])
    assert list(res) == ['dali_fastai detection train', 'fastai detection train'] and all(r > 0 for r in res.values())
    out = capsys.readouterr().out
    assert 'dali_fastai / fastai:' in out and f"{res['dali_fastai detection train']/res['fastai detection train']:.2f}x" in out
