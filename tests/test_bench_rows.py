"The compiled aug_transforms rows of `bench`: which settings reach them, and the output without them (no timing asserted)"
import contextlib, io
import pytest
import dali_fastai.bench as b
from dali_fastai.bench import bench
from dali_fastai.measure import bench_images
from dali_fastai.baselines import COMPILED, LEFTOVER


@pytest.fixture(scope='module')
def path(tmp_path_factory):
    with contextlib.redirect_stdout(io.StringIO()):
        return bench_images(tmp_path_factory.mktemp('bench')/'set', n_per_class=5, photos=('coffee', 'chelsea'), workers=1)


def run(path, **kw):
    "A miniature CPU bench, its printed table, and its results"
    with contextlib.redirect_stdout(io.StringIO()) as out:
        res = bench(path, size=32, bs=2, device='cpu', n_batches=2, warmup=1, passes=1, archs=(), out=None, **kw)
    return out.getvalue(),res


def test_without_fastai_tfms(path):
    txt,res = run(path, fastai_tfms=False, fastai_loader=False)
    assert list(res['loader']) == ['dali_fastai train', 'bare DALI iterator', 'dali_fastai valid']
    assert res['left_to_fastai'] == {} and 'aug_transforms_pipeline' not in res['memory']
    assert 'aug_transforms' not in txt
    assert txt.splitlines()[3] == f"{'loader':<24}{'img/s':>10}{'vs fastai':>11}"  # the narrow table of before


def test_settings_reach_the_compiled_loaders(path, monkeypatch):
    "Loader settings go to the compiled loaders too; augmentation keywords, which the fastai transforms replace, do not"
    seen, make = [], b.aug_transforms_dls
    def recording(*args, **kw):
        seen.append(kw); dls = make(*args, **kw)
        assert dls.train.dtype == 'float16' and dls.train.num_threads == 1
        return dls
    monkeypatch.setattr(b, 'aug_transforms_dls', recording)
    txt,res = run(path, fastai_loader=False, dtype='float16', num_threads=1, p_vflip=0.)
    assert [s.get('p_vflip') for s in seen] == [None, None] and [s['dtype'] for s in seen] == ['float16', 'float16']
    assert list(res['loader'])[-2:] == [COMPILED, LEFTOVER]
    assert res['left_to_fastai'] == {COMPILED: [], LEFTOVER: ['RandomErasing']}
    L = res['loader']
    # without fastai's loader: the ratios to the default row and to the compiled row, not the one to fastai
    assert f"  {L[COMPILED]/L['dali_fastai train']:.2f}x dali_fastai train" in txt
    assert f"RandomErasing left to fastai: {L[LEFTOVER]/L[COMPILED]:.2f}x the compiled rate" in txt
    assert 'fastai default train' not in txt


def test_peer_rows(path):
    "`peers=True`: each peer's img/s joins the loader rows (table and plot), and its own table follows, with the peers that do not run"
    txt,res = run(path, fastai_tfms=False, fastai_loader=False, peers=True, workers=0)
    peers = ['gpu_fastai (peer)', 'kornia (peer)', 'torchvision_v2 (peer)']
    assert list(res['loader'])[3:] == peers and all(res['loader'][k] > 0 for k in peers)
    rows = res['peers']['rows']
    assert list(rows) == ['dali_fastai train'] + peers
    assert all(rows[k]['vs_dali_fastai'] == rows[k]['img_s']/rows['dali_fastai train']['img_s'] for k in peers)
    assert 'peers, classification: 32px, bs 2, device cpu, files read by the main process' in txt
    assert 'ffcv: not measured: ' in txt and 'fastxtend: not measured: ' in txt
    from matplotlib.colors import to_rgba
    assert [p.get_facecolor() for p in b.plot_results(res).axes[0].patches][:3] == [to_rgba('tab:orange')]*3  # bars drawn bottom-up


def test_missing_peer(path, monkeypatch):
    "A peer whose package is missing is a line naming the extra, not a row"
    import importlib.util
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None if name == 'kornia' else find(name, *a))
    txt,res = run(path, fastai_tfms=False, fastai_loader=False, peers=True, workers=0)
    assert 'kornia (peer)' not in res['loader'] and 'torchvision_v2 (peer)' in res['loader']
    assert res['peers']['skipped'] == {'kornia': "kornia: skipped, `kornia` is not installed (pip install 'dali-fastai[bench]')"}
    assert "kornia: skipped, `kornia` is not installed (pip install 'dali-fastai[bench]')" in txt
