"Edge cases of `dali_fastai.scenes`: determinism, write-once, interrupted writes, the three annotation formats agree"
import json, sys
from importlib.resources import files
from xml.etree import ElementTree as ET
import numpy as np
import pytest
from PIL import Image
from dali_fastai import scenes
from dali_fastai.datasets import fashion_mnist_arrays
from dali_fastai.scenes import SCENE_CODES, compose_scene, fashion_scenes

N_TRAIN, N_VALID, SIZE = 12, 6, 96

@pytest.fixture(scope='module')
def small(tmp_path_factory):
    "A small scenes folder, shared by the tests that only read it"
    return fashion_scenes(tmp_path_factory.mktemp('scenes')/'s', n_train=N_TRAIN, n_valid=N_VALID, size=SIZE, progress=False)

def file_bytes(root):
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob('*')) if p.is_file()}

def test_layout(small):
    assert len(list((small/'JPEGImages').glob('*.jpg'))) == N_TRAIN + N_VALID
    assert len(list((small/'SegmentationClass').glob('*.png'))) == N_TRAIN + N_VALID
    assert len(list((small/'Annotations').glob('*.xml'))) == N_TRAIN + N_VALID
    assert (small/'ImageSets/Main/train.txt').read_text().split() == [f'train_{i:04d}' for i in range(N_TRAIN)]
    assert (small/'ImageSets/Main/val.txt').read_text().split() == [f'valid_{i:04d}' for i in range(N_VALID)]
    assert (small/'ImageSets/Segmentation/val.txt').read_text() == (small/'ImageSets/Main/val.txt').read_text()
    assert (small/'codes.txt').read_text().splitlines() == list(SCENE_CODES)
    im = Image.open(small/'JPEGImages/valid_0002.jpg')
    assert (im.format, im.mode, im.size) == ('JPEG', 'RGB', (SIZE, SIZE))

def test_same_arguments_same_bytes(small, tmp_path):
    again = fashion_scenes(tmp_path/'again', n_train=N_TRAIN, n_valid=N_VALID, size=SIZE, progress=False)
    a,b = file_bytes(small),file_bytes(again)
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)

def test_seed_changes_scenes(small, tmp_path):
    other = fashion_scenes(tmp_path/'other', n_train=2, n_valid=1, size=SIZE, seed=1, progress=False)
    assert (other/'JPEGImages/train_0000.jpg').read_bytes() != (small/'JPEGImages/train_0000.jpg').read_bytes()

def test_scene_i_independent_of_count(small, tmp_path):
    fewer = fashion_scenes(tmp_path/'fewer', n_train=3, n_valid=1, size=SIZE, progress=False)
    assert (fewer/'JPEGImages/train_0002.jpg').read_bytes() == (small/'JPEGImages/train_0002.jpg').read_bytes()

def test_second_call_does_not_rewrite(small, capsys):
    before = {p: p.stat().st_mtime_ns for p in small.rglob('*')}
    assert fashion_scenes(small, n_train=N_TRAIN, n_valid=N_VALID, size=SIZE) == small
    assert {p: p.stat().st_mtime_ns for p in small.rglob('*')} == before
    assert capsys.readouterr().out == ''

def test_other_recipe_rewrites(tmp_path):
    d = fashion_scenes(tmp_path/'d', n_train=2, n_valid=1, size=64, progress=False)
    fashion_scenes(d, n_train=3, n_valid=1, size=64, progress=False)
    assert len(list((d/'JPEGImages').glob('train_*.jpg'))) == 3

def test_refuses_foreign_folder(tmp_path):
    (tmp_path/'d').mkdir(); (tmp_path/'d'/'notes.txt').write_text('mine')
    with pytest.raises(FileExistsError, match='did not write'): fashion_scenes(tmp_path/'d', n_train=1, n_valid=1)
    assert [p.name for p in (tmp_path/'d').iterdir()] == ['notes.txt']

@pytest.mark.parametrize('exc', [RuntimeError('disk full'), KeyboardInterrupt()])
def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch, exc):
    n, voc = [0], scenes._voc_xml
    def failing(*args):
        n[0] += 1
        if n[0] == 3: raise exc
        return voc(*args)
    monkeypatch.setattr(scenes, '_voc_xml', failing)
    with pytest.raises(type(exc)): fashion_scenes(tmp_path/'d', n_train=4, n_valid=2, size=64, progress=False)
    assert list(tmp_path.iterdir()) == [], "an interrupted write must leave neither dest nor its temporary folder"
    monkeypatch.setattr(scenes, '_voc_xml', voc)
    d = fashion_scenes(tmp_path/'d', n_train=4, n_valid=2, size=64, progress=False)
    assert len(list((d/'Annotations').glob('*.xml'))) == 6

def test_valid_scenes_paste_valid_items(tmp_path, monkeypatch):
    "Validation scenes are composed from validation items only (1,000 rows), training scenes from training items (3,000)"
    seen, compose = [], scenes.compose_scene
    def spy(rng, items_x, items_y, *args, **kwargs):
        seen.append(len(items_x)); return compose(rng, items_x, items_y, *args, **kwargs)
    monkeypatch.setattr(scenes, 'compose_scene', spy)
    fashion_scenes(tmp_path/'d', n_train=2, n_valid=1, size=64, progress=False)
    assert seen == [3000, 3000, 1000]

def test_formats_agree(small):
    "COCO boxes are VOC boxes (1-based inclusive pixels); every class's mask pixels lie inside its boxes"
    for split,voc_split in (('train', 'train'), ('valid', 'val')):
        coco = json.loads((small/f'annotations/{split}.json').read_text())
        assert [c['name'] for c in sorted(coco['categories'], key=lambda c: c['id'])] == list(SCENE_CODES[1:])
        assert [i['file_name'][:-4] for i in coco['images']] == (small/f'ImageSets/Main/{voc_split}.txt').read_text().split()
        for im in coco['images']:
            cb = sorted((a['category_id'], [a['bbox'][0], a['bbox'][1], a['bbox'][0]+a['bbox'][2], a['bbox'][1]+a['bbox'][3]])
                        for a in coco['annotations'] if a['image_id'] == im['id'])
            assert cb, f"scene {im['file_name']} has no object"
            xml = ET.parse(small/'Annotations'/(im['file_name'][:-4] + '.xml')).getroot()
            assert xml.find('filename').text == im['file_name']
            vb = sorted((SCENE_CODES.index(o.find('name').text), [int(o.find(f'bndbox/{k}').text) - d for k,d in
                         (('xmin', 1), ('ymin', 1), ('xmax', 0), ('ymax', 0))]) for o in xml.iter('object'))
            assert vb == cb, im['file_name']
            mask = np.asarray(Image.open(small/'SegmentationClass'/(im['file_name'][:-4] + '.png')))
            assert mask.shape == (SIZE, SIZE) and mask.max() < len(SCENE_CODES)
            for c in np.unique(mask)[1:]:
                inside = np.zeros(mask.shape, bool)
                for cat,(l,t,r,b) in cb:
                    if cat == c: inside[int(t):int(b), int(l):int(r)] = True
                assert not ((mask == c) & ~inside).any(), f"{im['file_name']}: class {c} outside its boxes"
            assert {c for c,_ in cb} >= set(np.unique(mask)[1:].tolist())

def test_boxes_tight_on_silhouettes():
    "A lone item's box is exactly its silhouette's bounding box in the mask"
    a = fashion_mnist_arrays()
    for seed in range(5):
        img,boxes,labels,mask = compose_scene(np.random.default_rng(seed), a['train_x'], a['train_y'], n_items=(1, 1))
        ys,xs = np.nonzero(mask)
        assert boxes.tolist() == [[xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]]
        assert img.dtype == np.uint8 and img.std() > 10

def test_licence_shipped():
    data = files('dali_fastai')/'data'
    lic = (data/'SCIKIT_IMAGE_LICENSE').read_text()
    assert 'BSD-3-Clause' in lic and 'Redistribution and use' in lic
    for name in scenes.SCENE_PHOTOS: assert name in lic, name

def test_without_scikit_image_says_which_extra_installs_it(tmp_path, monkeypatch):
    "The scenes are made from scikit-image's sample photos: without it, fashion_scenes says so and writes nothing"
    monkeypatch.setitem(sys.modules, 'skimage', None)
    with pytest.raises(ImportError, match=r"fashion_scenes .*needs the module 'skimage'.*pip install 'dali-fastai\[detection\]'"):
        fashion_scenes(tmp_path/'s', n_train=2, n_valid=1, size=SIZE, progress=False)
    assert not (tmp_path/'s').exists()
