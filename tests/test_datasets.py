"Edge cases of `dali_fastai.datasets`: idempotence, interrupted and killed writes, races, output, the table, package data"
import hashlib, json, os, subprocess, sys
from importlib.resources import files
from pathlib import Path
import numpy as np
import pandas as pd
import pytest
from PIL import Image
from dali_fastai import datasets
from dali_fastai.datasets import FASHION_MNIST_CLASSES, fashion_mnist, fashion_mnist_arrays, fashion_mnist_df

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
    assert len(pd.read_csv(dest/'labels.csv')) == 4000
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
    def fail(root, stamp):
        assert len(list(root.rglob('*.jpg'))) == 4000 and (root/'labels.csv').exists()  # the marker comes last
        raise OSError('disk full')
    monkeypatch.setattr(datasets, '_write_marker', fail)
    with pytest.raises(OSError, match='disk full'): fashion_mnist(dest, progress=False)
    assert list(tmp_path.iterdir()) == []

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

def test_folder_of_the_previous_layout_gains_the_table(tmp_path):
    "A folder written before `labels.csv` existed (same images, marker without 'csv') is written again, with the table"
    dest = fashion_mnist(tmp_path/'fmnist', progress=False)
    (dest/'labels.csv').unlink()
    (dest/'.complete').write_text(json.dumps({'sha256': datasets._npz_digest(), 'train': 3000, 'valid': 1000}))
    fashion_mnist(dest, progress=False)
    assert_complete(dest)


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
    datasets._swap_in(tmp, dest, datasets._stamp(), force=False)
    assert not tmp.exists() and mtimes(dest) == before

def test_foreign_files_appearing_mid_write_are_kept(tmp_path):
    dest = tmp_path/'fmnist'
    tmp = tmp_path/(datasets._tmp_prefix(dest) + f'{os.getpid()}-race')
    tmp.mkdir()
    datasets._write_tree(tmp, progress=False)
    dest.mkdir(); (dest/'notes.txt').write_text('keep me')
    with pytest.raises(FileExistsError, match='filled with other files while fashion_mnist wrote'):
        datasets._swap_in(tmp, dest, datasets._stamp(), force=True, who='fashion_mnist')
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


# ------------------------------------------------------------------------------------------------ output to a log or pipe

def test_output_to_a_pipe_ends_its_lines(tmp_path):
    "Written to a non-terminal (a log, a pipe, CI), the output is whole lines: nothing is glued to what comes next"
    code = ("import sys\nfrom dali_fastai.datasets import fashion_mnist\n"
            "fashion_mnist(sys.argv[1])\nprint('next line')\n")
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(REPO), os.environ.get('PYTHONPATH', '')])}
    r = subprocess.run([sys.executable, '-c', code, str(tmp_path/'d')], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout == (f"Writing 4,000 Fashion-MNIST JPEGs into {tmp_path/'d'} (once; later calls reuse them)\n"
                        "next line\n"), repr(r.stdout[:300])


def test_progress_on_a_terminal_ends_its_line(capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, 'isatty', lambda: True)
    assert list(datasets._progress(range(5))) == list(range(5))
    print('next line')
    out = capsys.readouterr().out
    assert '[5/5 ' in out and out.endswith(']\nnext line\n'), repr(out[-80:])


def test_progress_interrupted_on_a_terminal_still_ends_its_line(capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, 'isatty', lambda: True)
    with pytest.raises(KeyboardInterrupt):
        for i in datasets._progress(range(5)):
            if i == 2: raise KeyboardInterrupt
    print('next line')
    assert capsys.readouterr().out.endswith('\nnext line\n')


# --------------------------------------------------------------------------------------------------- the table (csv)

def test_table_columns_and_files(written):
    df = pd.read_csv(written/'labels.csv')
    assert list(df.columns) == ['fname', 'label', 'tags', 'brightness', 'is_valid']
    pd.testing.assert_frame_equal(df, fashion_mnist_df())
    assert df.is_valid.dtype == bool and df.brightness.dtype == float
    assert [p for p in df.fname if not (written/p).is_file()] == []
    assert sorted(df.fname) == sorted(str(p.relative_to(written)) for p in written.rglob('*.jpg'))
    assert (df.fname.str.split('/').str[1] == df.label).all()  # the class folder
    assert (df.fname.str.startswith('valid/') == df.is_valid).all()


def test_tags_are_multi_label():
    df = fashion_mnist_df()
    tags = df.tags.str.split()
    assert set(tags.map(len)) == {1, 2, 3}
    vocab = sorted({t for ts in tags for t in ts})
    assert vocab == ['accessory', 'bottom', 'footwear', 'open', 'sleeves', 'top', 'warm']
    onehot = np.array([[t in ts for t in vocab] for ts in tags])
    assert (onehot.sum(1) > 1).mean() > 0.4  # many items have several tags
    assert len({tuple(r) for r in onehot}) == 10  # tag sets tell the classes apart ...
    assert sum(len(set(df.label[onehot[:, j]])) > 1 for j in range(len(vocab))) >= 5  # ... and most tags span classes


def test_tags_read_by_fastai_as_multi_category(written):
    "fastai's own reader takes the table as is: `label_delim=' '` gives one-hot multi-label targets"
    from fastai.vision.data import ImageDataLoaders
    df = pd.read_csv(written/'labels.csv')
    dls = ImageDataLoaders.from_df(df, written, fn_col='fname', label_col='tags', label_delim=' ', valid_col='is_valid',
                                   bs=8, num_workers=0, device='cpu')
    assert list(dls.vocab) == ['accessory', 'bottom', 'footwear', 'open', 'sleeves', 'top', 'warm']
    assert (len(dls.train_ds), len(dls.valid_ds)) == (3000, 1000)
    y = dls.train_ds[0][1]  # fastai's MultiCategory encoding of the first row
    assert y.tolist() == [float(t in df.tags[0].split()) for t in dls.vocab]


def test_brightness_is_the_files_mean_pixel(written):
    df = pd.read_csv(written/'labels.csv').iloc[::40]  # 100 images across classes and splits
    from_files = np.array([np.asarray(Image.open(written/f), np.float32).mean()/255 for f in df.fname])
    assert np.abs(from_files - df.brightness.values).max() < 0.01  # JPEG error only
    assert np.corrcoef(from_files, df.brightness.values)[0, 1] > 0.99
    assert df.brightness.std() > 0.05  # a target that varies


def test_sample_photo_without_scikit_image_names_the_extra(monkeypatch):
    "The benchmark set and the scenes are made from scikit-image's photos: without it, what needed them says which extra installs it"
    monkeypatch.setitem(sys.modules, 'skimage.data', None)
    with pytest.raises(ImportError, match=r"the benchmark set \(made from scikit-image's sample photos\) needs the module 'skimage.data'.*dali-fastai\[bench\]"):
        datasets.sample_photo('coffee', 'the benchmark set')
