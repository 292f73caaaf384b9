"""Bad and unusual image files: header checks (`dali_fastai.files`), what the loaders do with bad files, and every valid
but unusual kind of image coming out as a 3-channel `size`×`size` batch.

Every image is made with PIL in a temporary folder; all are tiny except one 8000×6000 JPEG. The check cache goes to a
temporary `XDG_CACHE_HOME` (the `cache_home` fixture), never to the user's."""
import gc, os, warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from fastai.learner import Learner
from PIL import Image, ImageOps
from nvidia.dali.pipeline import Pipeline

import dali_fastai.files as files_mod
from dali_fastai.files import check_image, check_images, cache_dir, bad_files_message
from dali_fastai.loader import DaliDataLoader, ImageItems
from dali_fastai.data import DaliDataLoaders
from helpers import denorm, tiny_model


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    "A private check cache for each test"
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path/'xdg'))
    return tmp_path/'xdg'


def rgb(h=12, w=16, seed=0): return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def solid(f, colour=(200, 40, 90), size=(10, 10), **save):
    Image.new('RGB', size, colour).save(f, **save)
    return f


def make_folder(root, n=(4, 3), bad=()):
    "`root/{train,valid}/{cat,dog}/i.jpg`, solid images; `bad`: {relative path: bytes} written as well"
    for split in ('train', 'valid'):
        for c,k in zip(('cat', 'dog'), n):
            (root/split/c).mkdir(parents=True, exist_ok=True)
            for i in range(k): solid(root/split/c/f'{i}.jpg', (60*i % 256, 100, 50 + 100*(c == 'dog')))
    for rel,data in dict(bad).items(): (root/rel).write_bytes(data)
    return root


def middle_garbage(f):
    "A JPEG whose markers are all intact but whose first Huffman table is bogus: passes the header check, decodes nowhere"
    rgb(40, 40).save(f, quality=90)
    b = bytearray(f.read_bytes())
    dht = b.index(b'\xff\xc4')  # the table's 16 code-length counts follow its marker, length and class byte
    b[dht + 5:dht + 21] = b'\xff'*16  # 16×255 codes: more than any table holds (libjpeg: "Bogus Huffman table")
    f.write_bytes(bytes(b))
    return f


# ---------------------------------------------------------------------------------------------------------------- files

def test_good_files_pass(tmp_path):
    for ext in ('jpg', 'png', 'bmp', 'tif', 'webp'):
        rgb().save(tmp_path/f'a.{ext}')
        assert check_image(tmp_path/f'a.{ext}') is None, ext


def test_zero_byte(tmp_path):
    (tmp_path/'a.jpg').write_bytes(b'')
    assert check_image(tmp_path/'a.jpg') == 'zero-byte file'


def test_text_with_image_extension(tmp_path):
    (tmp_path/'a.jpg').write_text('<html>404 not found</html>\n')
    assert check_image(tmp_path/'a.jpg') == 'text file, not an image'


def test_non_image_binary(tmp_path):
    (tmp_path/'a.png').write_bytes(bytes(range(256)))
    assert check_image(tmp_path/'a.png').startswith('not a JPEG/PNG/TIFF/WebP/BMP')


def test_truncated_jpeg_and_png(tmp_path):
    rgb(40, 40).save(tmp_path/'a.jpg'); rgb(40, 40).save(tmp_path/'a.png')
    for f in ('a.jpg', 'a.png'):
        b = (tmp_path/f).read_bytes()
        (tmp_path/f).write_bytes(b[:len(b)//2])
    assert check_image(tmp_path/'a.jpg').startswith('truncated JPEG')
    assert check_image(tmp_path/'a.png').startswith('truncated PNG')


def test_jpeg_padded_after_end_marker_passes(tmp_path):
    rgb().save(tmp_path/'a.jpg')
    with open(tmp_path/'a.jpg', 'ab') as fh: fh.write(bytes(16))
    assert check_image(tmp_path/'a.jpg') is None


def test_gif_is_named_as_unsupported(tmp_path):
    rgb().save(tmp_path/'a.gif')
    assert check_image(tmp_path/'a.gif').startswith('GIF image, which DALI cannot decode')


def test_loader_refuses_gif_saying_dali_cannot_decode_it(tmp_path):
    rgb().save(tmp_path/'a.gif'); solid(tmp_path/'b.png')
    with pytest.raises(ValueError, match=r"a\.gif' \(GIF image, which DALI cannot decode: convert it to PNG or JPEG\)"):
        DaliDataLoader(ImageItems([tmp_path/'a.gif', tmp_path/'b.png'], [0, 0], ['a']), bs=2, size=8, device='cpu')


def test_missing_and_directory(tmp_path):
    assert check_image(tmp_path/'nope.jpg') == 'file does not exist'
    (tmp_path/'d.jpg').mkdir()
    assert 'directory' in check_image(tmp_path/'d.jpg')


def test_unreadable_permissions(tmp_path):
    f = tmp_path/'a.jpg'; rgb().save(f); f.chmod(0)
    if os.geteuid() != 0:
        assert check_image(f).startswith('permission denied')
        return
    # root reads anything: check as `nobody`, in a child process, a file in a folder `nobody` can enter
    tmp_path.chmod(0o755); tmp_path.parent.chmod(0o755)
    r,w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(65534); os.setuid(65534)
            os.write(w, str(check_image(f)).encode())
        finally: os._exit(0)
    os.close(w); os.waitpid(pid, 0)
    got = os.read(r, 1000).decode()
    assert got.startswith('permission denied'), got


def test_check_images_order_and_parallel(tmp_path):
    fs = []
    for i in range(40):
        f = tmp_path/f'{i:02d}.jpg'
        if i % 7 == 3: f.write_bytes(b'')
        else: solid(f)
        fs.append(f)
    bad = check_images(fs, workers=4, cache=False)
    assert [Path(f).name for f,_ in bad] == [f'{i:02d}.jpg' for i in range(40) if i % 7 == 3]


def test_cache_skips_unchanged_files(tmp_path, monkeypatch, cache_home):
    fs = [solid(tmp_path/f'{i}.jpg') for i in range(6)]
    (tmp_path/'0.jpg').write_bytes(b'')
    opened = []
    real = files_mod.check_image
    monkeypatch.setattr(files_mod, 'check_image', lambda f: opened.append(Path(f).name) or real(f))
    assert [Path(f).name for f,_ in check_images(fs)] == ['0.jpg']
    assert len(opened) == 6 and cache_dir() == cache_home/'dali_fastai'
    assert list((cache_home/'dali_fastai'/'file_checks').glob('*.json')), "no cache file under XDG_CACHE_HOME"
    opened.clear()
    assert [Path(f).name for f,_ in check_images(fs)] == ['0.jpg']  # verdicts, good and bad, from the cache
    assert opened == []
    solid(tmp_path/'0.jpg'); os.utime(tmp_path/'0.jpg', ns=(1, 1))  # fixed now: size and mtime change
    assert check_images(fs) == [] and opened == ['0.jpg']
    opened.clear()
    assert check_images(fs, cache=False) == [] and len(opened) == 6


def test_full_check_finds_and_caches_middle_garbage(tmp_path):
    f = middle_garbage(tmp_path/'a.jpg')
    assert check_images([f]) == []  # the header check cannot see it
    assert 'PIL cannot decode' in dict(check_images([f], full=True))[str(f)]
    assert str(f) in dict(check_images([f]))  # remembered


def test_message_names_first_few_and_count():
    msg = bad_files_message([(f'data/train/cat/{i:04d}.jpg', 'zero-byte file') for i in range(8)], root='data', n=3)
    assert msg.startswith("cannot decode 'train/cat/0000.jpg' (zero-byte file); 'train/cat/0001.jpg'")
    assert 'and 5 more: remove them or pass skip_bad_files=True' in msg


# -------------------------------------------------------------------------------------------------------------- loaders

BAD = {'train/cat/empty.jpg': b'', 'train/dog/notes.jpg': b'just text\n', 'valid/cat/empty.jpg': b''}


def test_from_folder_refuses_bad_files_by_name(tmp_path):
    root = make_folder(tmp_path, bad=BAD)
    with pytest.raises(ValueError) as e: DaliDataLoaders.from_folder(root, bs=2, size=8, device='cpu')
    msg = str(e.value)
    for rel in BAD: assert repr(rel) in msg, (rel, msg)
    assert "(zero-byte file)" in msg and "(text file, not an image)" in msg and 'skip_bad_files=True' in msg
    assert 'nvImageCodec' not in msg


def test_skip_bad_files_one_warning_and_exact_len(tmp_path):
    root = make_folder(tmp_path, n=(5, 4), bad=BAD)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        dls = DaliDataLoaders.from_folder(root, bs=2, size=8, device='cpu', seed=0, skip_bad_files=True)
    mine = [x for x in w if 'skip_bad_files' in str(x.message)]
    assert len(mine) == 1, [str(x.message) for x in w]
    for rel in BAD: assert repr(rel) in str(mine[0].message)
    assert (len(dls.train_ds), len(dls.valid_ds)) == (9, 9)
    for dl in (dls.train, dls.valid, dls.valid.new(shuffle=True)):
        sizes = [len(x) for x,_ in dl]
        assert len(sizes) == len(dl), (dl, sizes)
    assert sum(len(x) for x,_ in dls.valid) == 9
    # copies (one_batch, get_preds' new) keep the checked items: no second warning
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        dls.train.one_batch(); dls.valid.new(bs=3)
    assert not [x for x in w if 'skip_bad_files' in str(x.message)]


def test_skip_bad_files_all_bad_valid_class_is_an_error(tmp_path):
    root = make_folder(tmp_path, n=(2, 2))
    for f in (root/'valid').rglob('*.jpg'): f.write_bytes(b'')
    with pytest.raises(ValueError, match='no images in the validation set, once the bad files are left out'):
        DaliDataLoaders.from_folder(root, bs=2, size=8, device='cpu', skip_bad_files=True)


def test_dali_data_loader_checks_its_items(tmp_path):
    good = [solid(tmp_path/f'{i}.png') for i in range(5)]
    (tmp_path/'z.png').write_bytes(b'')
    items = ImageItems([*good, tmp_path/'z.png'], [0]*6, ['a'])
    with pytest.raises(ValueError, match=r"z\.png' \(zero-byte file\): remove it or pass skip_bad_files=True"):
        DaliDataLoader(items, bs=4, size=8, device='cpu')
    with pytest.warns(UserWarning, match='leaving out 1 file'):
        dl = DaliDataLoader(items, bs=4, size=8, device='cpu', skip_bad_files=True)
    assert len(dl) == 2 and [len(x) for x,_ in dl] == [4, 1]
    assert len(DaliDataLoader(ImageItems(good, [0]*5, ['a']), bs=4, size=8, device='cpu', check_files=False)) == 2


@pytest.fixture
def learner(tmp_path):
    dls = DaliDataLoaders.from_folder(make_folder(tmp_path/'data'), bs=2, size=8, device='cpu', seed=0)
    return Learner(dls, tiny_model(2))


@pytest.mark.parametrize('kind', ['zero-byte', 'text', 'truncated'])
def test_test_dl_and_predict_name_the_bad_file(learner, tmp_path, kind):
    f = tmp_path/'bad.jpg'
    if kind == 'zero-byte': f.write_bytes(b'')
    elif kind == 'text': f.write_text('hello')
    else: rgb(40, 40).save(f); f.write_bytes(f.read_bytes()[:300])
    for call in (lambda: learner.dls.test_dl([f]), lambda: learner.predict(f)):
        with pytest.raises(ValueError) as e: call()
        assert f"cannot decode {str(f)!r}" in str(e.value) and 'nvImageCodec' not in str(e.value)


def dali_pipelines(): return sum(isinstance(o, Pipeline) for o in gc.get_objects())


@pytest.mark.parametrize('train', [False, True])
@pytest.mark.parametrize('where', [1, 12])  # in the first batch, or in the seventh (DALI reports it there)
def test_run_time_decode_failure_names_the_file(tmp_path, train, where):
    "A file that passes the header check but that DALI cannot decode: our error, naming it; then skip_bad_files works"
    fs = [solid(tmp_path/f'{i:02d}.jpg') for i in range(15)]
    bad = middle_garbage(fs[where])
    items = ImageItems(fs, [0]*15, ['a'])
    dl = DaliDataLoader(items, bs=2, size=8, device='cpu', train=True, warp_mode=None) if train else \
         DaliDataLoader(items, bs=2, size=8, device='cpu')
    gc.collect(); gc.disable()
    try:
        before = dali_pipelines()
        with pytest.raises(ValueError) as e: list(dl)
        # the dead pipeline is freed at once, not left in a reference cycle for the garbage collector (which would run
        # DALI's shutdown at a random later time, even in a forked child process, where it crashes)
        assert dl._source.it is None and dali_pipelines() == before
    finally: gc.enable()
    msg = str(e.value)
    assert repr(str(bad)) in msg and 'skip_bad_files=True' in msg and 'DALI could not decode' in msg, msg
    assert 'nvImageCodec' not in msg
    # recorded in the check cache: a new loader refuses it up front, or leaves it out
    with pytest.raises(ValueError, match=bad.name): DaliDataLoader(ImageItems(fs, [0]*15, ['a']), bs=2, size=8, device='cpu')
    with pytest.warns(UserWarning, match=bad.name):
        dl = DaliDataLoader(ImageItems(fs, [0]*15, ['a']), bs=2, size=8, device='cpu', skip_bad_files=True)
    assert [len(x) for x,_ in dl] == [2]*7


# ------------------------------------------------------------------------------------------------ unusual valid images

# The unusual-image tests run on the CPU backend; on a GPU machine, `DALI_FASTAI_TEST_DEVICE=gpu` runs them through the
# GPU decoders ('mixed'), whose format support differs from the CPU's.
DEVICE = os.environ.get('DALI_FASTAI_TEST_DEVICE', 'cpu')


def out_pixels(f, size=8, train=False, **kw):
    "One image through a loader on `DEVICE`: its 0..255 HWC pixels, after checking the batch is 3×size×size"
    dl = DaliDataLoader(ImageItems([f], [0], ['a']), bs=1, size=size, device=DEVICE, train=train, seed=0, **kw)
    x, = [b[0].cpu() for b in dl]
    assert tuple(x.shape) == (1, 3, size, size) and torch.isfinite(x).all()
    return denorm(x)[0].permute(1, 2, 0).numpy()


def colour_of(f, **kw): return out_pixels(f, **kw).reshape(-1, 3).mean(0)


UNUSUAL = {  # name: (writer of a 10×14 image of one colour, the RGB PIL's convert('RGB') gives)
    'gray.jpg':    (lambda f: Image.new('L', (14, 10), 120).save(f), (120, 120, 120)),
    'cmyk.jpg':    (lambda f: Image.new('CMYK', (14, 10), (0, 200, 200, 0)).save(f), None),
    'rgba.png':    (lambda f: Image.new('RGBA', (14, 10), (200, 40, 90, 255)).save(f), (200, 40, 90)),
    'palette.png': (lambda f: Image.new('RGB', (14, 10), (200, 40, 90)).convert('P').save(f), None),
    'la.png':      (lambda f: Image.new('LA', (14, 10), (77, 255)).save(f), (77, 77, 77)),
    'bilevel.png': (lambda f: Image.new('1', (14, 10), 1).save(f), (255, 255, 255)),
    'gray16.png':  (lambda f: Image.fromarray(np.full((10, 14), 30000, np.uint16)).save(f), (117, 117, 117)),
    'a.bmp':       (lambda f: solid(f, size=(14, 10)), (200, 40, 90)),
    'a.tif':       (lambda f: solid(f, size=(14, 10)), (200, 40, 90)),
    'lzw.tif':     (lambda f: solid(f, size=(14, 10), compression='tiff_lzw'), (200, 40, 90)),
    'a.webp':      (lambda f: solid(f, size=(14, 10), lossless=True), (200, 40, 90)),
    'a.jp2':       (lambda f: solid(f, size=(14, 10)), (200, 40, 90)),
    'a.ppm':       (lambda f: solid(f, size=(14, 10)), (200, 40, 90)),
}


@pytest.mark.parametrize('name', list(UNUSUAL))
@pytest.mark.parametrize('train', [False, True])
def test_unusual_images_load_as_rgb(tmp_path, name, train):
    write,expected = UNUSUAL[name]
    f = tmp_path/name; write(f)
    if expected is None: expected = np.array(Image.open(f).convert('RGB')).reshape(-1, 3).mean(0)
    kw = dict(warp_mode=None, p_hflip=0, p_vflip=0, p_rotate=0) if train else {}
    got = colour_of(f, train=train, **kw)
    # 16-bit: DALI scales to 8 bits (30000/257 = 117); PIL's convert('RGB') would clip to 255
    assert np.abs(got - np.array(expected)).max() < 6, (name, got, expected)


@pytest.mark.parametrize('shape', [(1, 1), (1, 500), (500, 1)])
@pytest.mark.parametrize('ext', ['jpg', 'png'])
@pytest.mark.parametrize('train', [False, True])
def test_tiny_and_extreme_aspect_ratios(tmp_path, shape, ext, train):
    h,w = shape
    f = solid(tmp_path/f'a.{ext}', (30, 200, 120), size=(w, h))
    kw = dict(warp_mode=None) if train else {}
    assert np.abs(colour_of(f, train=train, **kw) - np.array((30, 200, 120))).max() < 8


def test_very_large_image(tmp_path):
    f = tmp_path/'big.jpg'
    Image.new('RGB', (8000, 6000), (30, 200, 120)).save(f, quality=80)
    for train in (False, True):
        got = colour_of(f, size=16, train=train, **({'warp_mode': None} if train else {}))
        assert np.abs(got - np.array((30, 200, 120))).max() < 8, (train, got)


QUADRANTS = ((220, 30, 30), (30, 220, 30), (30, 30, 220), (220, 220, 30))


def quadrant_image(side=32):
    a = np.zeros((side, side, 3), np.uint8); h = side//2
    for (r,c),col in zip([(0, 0), (0, 1), (1, 0), (1, 1)], QUADRANTS): a[r*h:(r+1)*h, c*h:(c+1)*h] = col
    return Image.fromarray(a)


def quadrants(a):
    h = a.shape[0]//2
    return np.array([a[r*h:(r+1)*h, c*h:(c+1)*h].reshape(-1, 3).mean(0) for r in (0, 1) for c in (0, 1)])


@pytest.mark.parametrize('orientation', range(1, 9))
def test_exif_orientation_as_pil(tmp_path, orientation):
    "Every EXIF orientation comes out as PIL's `ImageOps.exif_transpose` shows it (DALI's `adjust_orientation=True`)"
    f = tmp_path/'a.jpg'
    exif = Image.Exif(); exif[0x0112] = orientation
    quadrant_image().save(f, quality=95, exif=exif)
    expected = quadrants(np.asarray(ImageOps.exif_transpose(Image.open(f)).convert('RGB'), dtype=float))
    for train in (False, True):
        kw = dict(warp_mode=None, p_hflip=0, p_vflip=0, p_rotate=0, area=(1, 1), ratio=(1, 1)) if train else dict(crop_pct=1)
        got = quadrants(out_pixels(f, size=16, train=train, **kw))
        assert np.abs(got - expected).max() < 30, (orientation, train, got.round(), expected.round())


def test_exif_rotated_non_square(tmp_path):
    "A 40×20 image tagged 'rotate 90° clockwise' (6) is 20 wide and 40 tall: its left half (red) ends up on top"
    a = np.zeros((20, 40, 3), np.uint8); a[:, :20] = (220, 30, 30); a[:, 20:] = (30, 30, 220)
    exif = Image.Exif(); exif[0x0112] = 6
    f = tmp_path/'a.jpg'; Image.fromarray(a).save(f, quality=95, exif=exif)
    p = out_pixels(f, size=16, crop_pct=1)
    top,bottom = p[:8].reshape(-1, 3).mean(0),p[8:].reshape(-1, 3).mean(0)
    assert top[0] > 150 > top[2] and bottom[2] > 150 > bottom[0], (top, bottom)
