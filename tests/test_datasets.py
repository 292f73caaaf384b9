"Edge cases of `dali_fastai.datasets`: idempotence, interrupted and killed writes, races, package data"
import hashlib, json, os, subprocess, sys
from importlib.resources import files
from pathlib import Path
import numpy as np
import pytest
from PIL import Image
from dali_fastai import datasets
from dali_fastai.datasets import FASHION_MNIST_CLASSES, fashion_mnist, fashion_mnist_arrays

REPO = Path(__file__).resolve().parent.parent

def mtimes(root:Path)->dict:
    "Modification time (ns) of every file and folder under `root`"
    return {p.relative_to(root): p.stat().st_mtime_ns for p in root.rglob('*')}

def assert_complete(dest:Path):
    "`dest` holds the full dataset, and nothing of a writer is left beside it"
    for split,n in (('train', 300), ('valid', 100)):
        counts = {c: len(list((dest/split/c).glob('*.jpg'))) for c in FASHION_MNIST_CLASSES}
        assert counts == {c: n for c in FASHION_MNIST_CLASSES}, f"{split}: {counts}"
    assert json.loads((dest/'.complete').read_text())['sha256'] == datasets._npz_digest()
    assert [p.name for p in dest.parent.iterdir() if '.tmp-' in p.name] == [], "temporary folder left behind"

@pytest.fixture(scope='module')
def written(tmp_path_factory)->Path:
    "One complete dataset, shared by the tests that only read it"
    return fashion_mnist(tmp_path_factory.mktemp('shared')/'fmnist', progress=False)

def test_complete_and_class_balanced(written):
    assert_complete(written)
    assert sorted(p.name for p in (written/'train').iterdir()) == sorted(FASHION_MNIST_CLASSES)
    assert len(list(written.rglob('*.jpg'))) == 4000

def test_arrays_class_balanced():
    a = fashion_mnist_arrays()
    assert np.bincount(a['train_y'], minlength=10).tolist() == [300]*10
    assert np.bincount(a['valid_y'], minlength=10).tolist() == [100]*10
    assert tuple(a['classes']) == FASHION_MNIST_CLASSES
    # train and valid come from different official splits; rows within a split are distinct
    assert len(set(a['train_idx'].tolist())) == 3000 and len(set(a['valid_idx'].tolist())) == 1000

def test_files_trace_back_to_arrays(written):
    a = fashion_mnist_arrays()
    for split in ('train', 'valid'):
        for i in (0, 7, len(a[f'{split}_y'])-1):
            f = written/split/FASHION_MNIST_CLASSES[a[f'{split}_y'][i]]/f'{i:04d}.jpg'
            im = Image.open(f)
            assert (im.format, im.mode, im.size) == ('JPEG', 'L', (28, 28))
            assert np.abs(np.asarray(im, np.float32) - a[f'{split}_x'][i]).mean() < 3, f

def test_second_call_does_not_rewrite(written):
    before = mtimes(written)
    assert fashion_mnist(written, progress=False) == written  # no timing assertion: mtimes show it (timings flake)
    assert mtimes(written) == before

def test_second_call_is_silent(written, capsys):
    fashion_mnist(written)
    assert capsys.readouterr().out == ''

def test_first_call_says_what_it_writes(tmp_path, capsys):
    fashion_mnist(tmp_path/'d')
    assert 'Writing 4,000 Fashion-MNIST JPEGs' in capsys.readouterr().out

@pytest.mark.parametrize('exc', [RuntimeError('disk full'), KeyboardInterrupt()])
def test_interrupted_write_is_redone(tmp_path, monkeypatch, exc):
    dest, n, save = tmp_path/'fmnist', [0], datasets._save_jpeg
    def failing_save(img, path):
        n[0] += 1
        if n[0] == 1500: raise exc
        save(img, path)
    monkeypatch.setattr(datasets, '_save_jpeg', failing_save)
    with pytest.raises(type(exc)): fashion_mnist(dest, progress=False)
    assert n[0] == 1500
    assert list(tmp_path.iterdir()) == [], "an interrupted write must leave neither dest nor its temporary folder"
    monkeypatch.setattr(datasets, '_save_jpeg', save)
    assert_complete(fashion_mnist(dest, progress=False))

def test_failure_while_writing_marker_leaves_no_dest(tmp_path, monkeypatch):
    dest = tmp_path/'fmnist'
    monkeypatch.setattr(datasets, '_npz_digest', lambda: (_ for _ in ()).throw(OSError('read error')))
    with pytest.raises(OSError): fashion_mnist(dest, progress=False)
    assert not dest.exists()

def test_killed_writer_is_cleaned_up_and_redone(tmp_path):
    "A writer killed outright (no exception handler runs) leaves its temporary folder; the next call removes it"
    dest = tmp_path/'fmnist'
    code = ("import os, sys\nfrom dali_fastai import datasets\nn, save = [0], datasets._save_jpeg\n"
            "def die(img, path):\n    save(img, path); n[0] += 1\n    if n[0] == 100: os._exit(3)\n"
            "datasets._save_jpeg = die\ndatasets.fashion_mnist(sys.argv[1], progress=False)\n")
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(REPO), os.environ.get('PYTHONPATH', '')])}
    r = subprocess.run([sys.executable, '-c', code, str(dest)], env=env, capture_output=True, text=True)
    assert r.returncode == 3, r.stderr
    assert not dest.exists()
    left = [p for p in tmp_path.iterdir() if '.tmp-' in p.name]
    assert len(left) == 1 and len(list(left[0].rglob('*.jpg'))) == 100
    assert_complete(fashion_mnist(dest, progress=False))

def test_live_writers_tmp_is_left_alone(tmp_path):
    busy = tmp_path/(datasets._tmp_prefix(tmp_path/'fmnist') + f'{os.getpid()}-busy')
    busy.mkdir()
    fashion_mnist(tmp_path/'fmnist', progress=False)
    assert busy.is_dir()

def test_marker_from_another_release_is_rewritten(tmp_path):
    dest = fashion_mnist(tmp_path/'fmnist', progress=False)
    (dest/'.complete').write_text(json.dumps({'sha256': 'from an older release'}))
    f = dest/'train'/'Bag'/'0000.jpg'
    f.write_bytes(b'stale')
    fashion_mnist(dest, progress=False)
    assert_complete(dest)
    assert len(list(dest.rglob('*.jpg'))) == 4000
    assert not any(p.read_bytes() == b'stale' for p in dest.rglob('*.jpg'))

def test_force_rewrites(tmp_path):
    dest = fashion_mnist(tmp_path/'fmnist', progress=False)
    (dest/'train'/'Bag'/'extra.jpg').write_bytes(b'not ours')
    fashion_mnist(dest, force=True, progress=False)
    assert_complete(dest)
    assert not (dest/'train'/'Bag'/'extra.jpg').exists()

def test_lost_race_keeps_the_winners_folder(tmp_path):
    "Two processes write at once: the second to finish finds a complete dest and discards its own copy"
    dest = fashion_mnist(tmp_path/'fmnist', progress=False)
    before = mtimes(dest)
    tmp = tmp_path/(datasets._tmp_prefix(dest) + f'{os.getpid()}-race')
    tmp.mkdir()
    datasets._write_tree(tmp, progress=False)
    datasets._swap_in(tmp, dest, force=False)
    assert not tmp.exists() and mtimes(dest) == before

def test_foreign_files_appearing_mid_write_are_kept(tmp_path):
    dest = tmp_path/'fmnist'
    tmp = tmp_path/(datasets._tmp_prefix(dest) + f'{os.getpid()}-race')
    tmp.mkdir()
    datasets._write_tree(tmp, progress=False)
    dest.mkdir(); (dest/'notes.txt').write_text('keep me')
    with pytest.raises(FileExistsError, match='filled with other files'): datasets._swap_in(tmp, dest, force=True)
    assert (dest/'notes.txt').read_text() == 'keep me'

def test_dest_is_a_file(tmp_path):
    (tmp_path/'f').write_text('x')
    with pytest.raises(FileExistsError, match='is a file, not a folder'): fashion_mnist(tmp_path/'f', progress=False)
    assert (tmp_path/'f').read_text() == 'x'

def test_dest_with_foreign_files_is_never_deleted(tmp_path):
    d = tmp_path/'mine'; d.mkdir(); (d/'notes.txt').write_text('keep me')
    for force in (False, True):
        with pytest.raises(FileExistsError, match='did not write'): fashion_mnist(d, force=force, progress=False)
    assert [p.name for p in d.iterdir()] == ['notes.txt']

def test_default_dest_respects_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path))
    dest = fashion_mnist(progress=False)
    assert dest == tmp_path/'dali_fastai'/'fashion_mnist_small'
    assert_complete(dest)

def test_default_dest_without_xdg_is_home_cache(tmp_path, monkeypatch):
    monkeypatch.delenv('XDG_CACHE_HOME', raising=False)
    monkeypatch.setenv('HOME', str(tmp_path))
    assert fashion_mnist(progress=False) == tmp_path/'.cache'/'dali_fastai'/'fashion_mnist_small'

def test_licence_and_readme_shipped():
    data = files('dali_fastai')/'data'
    lic = (data/'FASHION_MNIST_LICENSE').read_text()
    assert 'Zalando SE' in lic and 'Permission is hereby granted, free of charge' in lic
    assert 'make_fashion_mnist.py' in (data/'README.md').read_text()
    assert len((data/'fashion_mnist_small.npz').read_bytes()) < 2_000_000

def test_readme_digest_matches_npz():
    data = files('dali_fastai')/'data'
    assert hashlib.sha256((data/'fashion_mnist_small.npz').read_bytes()).hexdigest() in (data/'README.md').read_text()

@pytest.mark.skipif(not Path('/usr/share/datasets/fashion-mnist').exists(),
                    reason="needs the Debian package dataset-fashion-mnist")
def test_tool_rebuilds_the_same_bytes(tmp_path):
    subprocess.run([sys.executable, str(REPO/'tools'/'make_fashion_mnist.py'), '--out', str(tmp_path)], check=True,
                   capture_output=True)
    shipped = files('dali_fastai')/'data'
    for name in ('fashion_mnist_small.npz', 'FASHION_MNIST_LICENSE', 'README.md'):
        assert (tmp_path/name).read_bytes() == (shipped/name).read_bytes(), name
