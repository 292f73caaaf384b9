"Readers of `dali_fastai.annotations`: COCO and VOC agree, options, and each bad annotation's message"
import json, warnings
from pathlib import Path
import numpy as np
import pytest
import torch
from PIL import Image
from fastai.vision.all import get_annotations
from dali_fastai.annotations import ImageBoxes, read_coco, read_voc, to_fastai, from_fastai
from dali_fastai.scenes import SCENE_CODES, fashion_scenes

@pytest.fixture(scope='module')
def scenes(tmp_path_factory):
    return fashion_scenes(tmp_path_factory.mktemp('scenes')/'s', n_train=10, n_valid=5, size=96, progress=False)

@pytest.mark.parametrize('split,voc_split', [('train', 'train'), ('valid', 'val')])
def test_coco_and_voc_agree(scenes, split, voc_split):
    c,cv = read_coco(scenes/f'annotations/{split}.json', scenes/'JPEGImages')
    v,vv = read_voc(scenes, voc_split, vocab=cv)
    assert cv == vv == list(SCENE_CODES[1:])
    assert [r.file for r in c] == [r.file for r in v] and len(c) == (10 if split == 'train' else 5)
    for a,b in zip(c, v):
        np.testing.assert_array_equal(a.boxes, b.boxes)
        assert a.labels == b.labels and len(a.labels) >= 1
    assert read_voc(scenes, voc_split)[1] == sorted({l for r in v for l in r.labels})

def test_fastai_format(scenes):
    recs,_ = read_coco(scenes/'annotations/train.json', scenes/'JPEGImages')
    assert to_fastai(recs) == get_annotations(scenes/'annotations/train.json', prefix=f"{scenes/'JPEGImages'}/")
    back = from_fastai(*to_fastai(recs))
    assert [(r.file, r.boxes.tolist(), r.labels) for r in back] == [(r.file, r.boxes.tolist(), r.labels) for r in recs]
    with pytest.raises(ValueError, match='got 2 files but 1 annotations'): from_fastai(['a', 'b'], [([], [])])

# --- a hand-made COCO set: three 40x30 images ---
def write_images(folder:Path, names=('a.jpg', 'b.jpg', 'c.jpg')):
    folder.mkdir(parents=True, exist_ok=True)
    for n in names: Image.new('RGB', (40, 30), 'gray').save(folder/n)

def coco_dict():
    return dict(
        images=[dict(id=1, file_name='a.jpg', width=40, height=30), dict(id=2, file_name='b.jpg', width=40, height=30),
                dict(id=7, file_name='c.jpg', width=40, height=30)],
        annotations=[dict(id=10, image_id=1, category_id=3, bbox=[1, 2, 10, 5], iscrowd=0),
                     dict(id=11, image_id=1, category_id=5, bbox=[20, 10, 19.5, 20]),
                     dict(id=12, image_id=2, category_id=3, bbox=[0, 0, 40, 30], iscrowd=1)],
        categories=[dict(id=5, name='dog'), dict(id=3, name='cat')])

def write_coco(tmp_path, d)->Path:
    write_images(tmp_path/'img')
    (tmp_path/'ann.json').write_text(json.dumps(d))
    return tmp_path/'ann.json'

def test_coco_basics(tmp_path):
    recs,vocab = read_coco(write_coco(tmp_path, coco_dict()), tmp_path/'img')
    assert vocab == ['cat', 'dog']  # category id order
    assert [r.file.name for r in recs] == ['a.jpg', 'b.jpg', 'c.jpg']  # images without boxes kept
    assert recs[0].boxes.tolist() == [[1, 2, 11, 7], [20, 10, 39.5, 30]] and recs[0].labels == ['cat', 'dog']
    assert recs[1].boxes.shape == (0, 4) and recs[1].labels == []  # its only box is a crowd box
    assert recs[0].boxes.dtype == np.float32

def test_coco_options(tmp_path):
    f = write_coco(tmp_path, coco_dict())
    recs,_ = read_coco(f, tmp_path/'img', keep_crowd=True, keep_empty=False)
    assert [r.file.name for r in recs] == ['a.jpg', 'b.jpg'] and recs[1].boxes.tolist() == [[0, 0, 40, 30]]
    d = coco_dict()
    for a in d['annotations']: a['bbox'] = [a['bbox'][0], a['bbox'][1], a['bbox'][0] + a['bbox'][2], a['bbox'][1] + a['bbox'][3]]
    (tmp_path/'ltrb.json').write_text(json.dumps(d))
    assert read_coco(tmp_path/'ltrb.json', tmp_path/'img', bbox_format='ltrb')[0][0].boxes.tolist() == [[1, 2, 11, 7], [20, 10, 39.5, 30]]
    with pytest.raises(ValueError, match="bbox_format must be 'xywh' or 'ltrb'"): read_coco(f, tmp_path/'img', bbox_format='xyxy')

def test_coco_clips_within_tolerance(tmp_path):
    d = coco_dict(); d['annotations'][0]['bbox'] = [-0.6, 0, 41, 30.8]
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # within tol: no warning
        recs,_ = read_coco(write_coco(tmp_path, d), tmp_path/'img')
    assert recs[0].boxes[0].tolist() == [0, 0, 40, 30]

def test_coco_clips_overhanging_boxes_as_fastai_does(tmp_path):
    "Boxes past the edge by more than tol are clipped, with one warning counting them and naming the first file; those left empty go"
    d = coco_dict()
    d['annotations'][0]['bbox'] = [30, 2, 13, 5]  # ltrb [30, 2, 43, 7]: 3 px past the right edge of the 40x30 image
    d['annotations'].append(dict(id=13, image_id=7, category_id=5, bbox=[-5, 20, 8, 13]))  # [-5, 20, 3, 33]: past the left and bottom edges
    d['annotations'].append(dict(id=14, image_id=7, category_id=3, bbox=[40, 3, 0.8, 4]))  # [40, 3, 40.8, 7]: within tol, but no area inside
    with pytest.warns(UserWarning) as w: recs,vocab = read_coco(write_coco(tmp_path, d), tmp_path/'img')
    assert len(w) == 1, [str(x.message) for x in w]
    msg = str(w[0].message)
    assert msg.startswith(f"'{tmp_path/'ann.json'}': clipped 2 box(es) that pass their image's edge by more than tol=1 px and "
                          "dropped 1 box(es) left with no area inside their image"), msg
    assert f"the first is in '{tmp_path/'img'/'a.jpg'}' (40x30), box [30, 2, 43, 7]" in msg
    assert recs[0].boxes.tolist() == [[30, 2, 40, 7], [20, 10, 39.5, 30]] and recs[0].labels == ['cat', 'dog']
    assert recs[2].boxes.tolist() == [[0, 20, 3, 30]] and recs[2].labels == ['dog']  # the empty box and its label dropped
    # fastai's own clip_remove_empty on the same boxes (in [-1, 1]) keeps the same ones, clipped the same way
    from fastai.vision.all import TensorBBox, TensorMultiCategory
    from fastai.vision.data import clip_remove_empty
    raw = np.array([[-5, 20, 3, 33], [40, 3, 40.8, 7]], np.float32)
    b,l = clip_remove_empty(TensorBBox(torch.tensor(raw*2/[40, 30, 40, 30] - 1)), TensorMultiCategory(torch.tensor([2, 1])))
    np.testing.assert_allclose(((b + 1)*torch.tensor([20., 15, 20, 15])).numpy(), recs[2].boxes, atol=1e-5)
    assert l.tolist() == [2]

def test_voc_clips_overhanging_boxes(tmp_path):
    xmls = good_voc(); xmls['a'] = voc_xml([('cat', (30, 3, 45, 7), 0)])  # edges [29, 2, 45, 7]: 5 px past the right edge
    with pytest.warns(UserWarning, match=r"clipped 1 box\(es\) .* the first is in '.*a.jpg' \(40x30\), box \[29, 2, 45, 7\]"):
        recs,_ = read_voc(write_voc(tmp_path, xmls))
    assert recs[0].boxes.tolist() == [[29, 2, 40, 7]] and recs[0].labels == ['cat']

BAD_COCO = [  # (change to the good dict, the message's line)
    (lambda d: d['annotations'][0].update(bbox=[41, 2, 15, 5]), "annotation id 10 (image id 1): box [41, 2, 56, 7] (ltrb) lies wholly outside the 40x30 image"),
    (lambda d: d['annotations'][0].update(bbox=[-9, 2, 8, 5]), "annotation id 10 (image id 1): box [-9, 2, -1, 7] (ltrb) lies wholly outside the 40x30 image"),
    (lambda d: d['annotations'][0].update(bbox=[1, 2, 0, 5]), "annotation id 10 (image id 1): box [1, 2, 1, 7] (ltrb) has zero or negative size (0 x 5)"),
    (lambda d: d['annotations'][0].update(bbox=[1, 2, 10, -5]), "annotation id 10 (image id 1): box [1, 2, 11, -3] (ltrb) has zero or negative size (10 x -5)"),
    (lambda d: d['annotations'][0].update(bbox=[1, 2, 10]), "annotation id 10 (image id 1): bbox [1, 2, 10] is not 4 numbers"),
    (lambda d: d['annotations'][0].update(category_id=4), "annotation id 10 (image id 1): unknown category id 4 (known: [3, 5])"),
    (lambda d: d['annotations'][0].update(image_id=99), "annotation id 10 (image id 99): no image has this id"),
    (lambda d: d['annotations'][0].pop('bbox'), "annotation #0 (id 10) has no 'bbox' key"),
    (lambda d: d['images'][0].update(file_name='gone.jpg'), "image id 1: file '{root}/img/gone.jpg' does not exist"),
    (lambda d: d['images'][2].pop('width'), "image #2 (id 7) has no 'width' key"),
]

@pytest.mark.parametrize('change,line', BAD_COCO, ids=[l.split(': ')[-1][:30] for _,l in BAD_COCO])
def test_coco_bad(tmp_path, change, line):
    d = coco_dict(); change(d)
    f,line = write_coco(tmp_path, d),line.format(root=tmp_path)
    with pytest.raises(ValueError) as e: read_coco(f, tmp_path/'img')
    msg = str(e.value)
    assert msg.startswith(f"'{f}': 1 bad annotation(s):\n  {line}\n"), msg
    assert 'skip_bad=True' in msg
    with pytest.warns(UserWarning) as w: recs,_ = read_coco(f, tmp_path/'img', skip_bad=True)
    assert len(w) == 1 and line in str(w[0].message) and 'skipped 1 bad annotation(s)' in str(w[0].message)
    good,_ = read_coco(write_coco(tmp_path/'good', coco_dict()), tmp_path/'good'/'img')
    n_boxes = lambda rs: sum(len(r.labels) for r in rs)
    assert n_boxes(recs) == n_boxes(good) - 1 or len(recs) == len(good) - 1  # the bad box, or the bad image (and its boxes), is dropped
    assert 'gone.jpg' not in {r.file.name for r in recs}

def test_coco_all_problems_listed_once(tmp_path):
    d = coco_dict(); d['annotations'][0]['category_id'] = 4; d['annotations'][1]['bbox'] = [50, 0, 20, 5]
    with pytest.raises(ValueError, match=r"2 bad annotation\(s\):\n  annotation id 10 .*\n  annotation id 11 "):
        read_coco(write_coco(tmp_path, d), tmp_path/'img')

def test_coco_bad_files(tmp_path):
    (tmp_path/'x.json').write_text('{"images": [')
    with pytest.raises(ValueError, match=r"'.*x.json' is not valid JSON"): read_coco(tmp_path/'x.json', tmp_path)
    (tmp_path/'y.json').write_text(json.dumps(dict(images=[], annotations=[])))
    with pytest.raises(ValueError, match=r"'.*y.json' has no 'categories' key"): read_coco(tmp_path/'y.json', tmp_path)
    d = coco_dict(); d['categories'][0].pop('name')
    with pytest.raises(ValueError, match=r"category #0 \(id 5\) has no 'name' key"): read_coco(write_coco(tmp_path, d), tmp_path/'img')
    with pytest.raises(ValueError, match="category"): read_coco(write_coco(tmp_path, d), tmp_path/'img', skip_bad=True)

# --- a hand-made VOC set ---
def voc_xml(objs, filename='a.jpg', size=(40, 30)):
    o = ''.join(f"<object><name>{n}</name><difficult>{d}</difficult><bndbox><xmin>{b[0]}</xmin><ymin>{b[1]}</ymin>"
                f"<xmax>{b[2]}</xmax><ymax>{b[3]}</ymax></bndbox></object>" for n,b,d in objs)
    sz = f"<size><width>{size[0]}</width><height>{size[1]}</height><depth>3</depth></size>" if size else ''
    return f"<annotation><filename>{filename}</filename>{sz}{o}</annotation>"

def write_voc(root:Path, xmls:dict, split='train')->Path:
    write_images(root/'JPEGImages', [f'{k}.jpg' for k in xmls])
    (root/'Annotations').mkdir(exist_ok=True); (root/'ImageSets/Main').mkdir(parents=True, exist_ok=True)
    for k,x in xmls.items(): (root/'Annotations'/f'{k}.xml').write_text(x)
    (root/'ImageSets/Main'/f'{split}.txt').write_text(''.join(f'{k}\n' for k in xmls))
    return root

def good_voc(): return {'a': voc_xml([('cat', (2, 3, 11, 7), 0), ('dog', (21, 11, 40, 30), 1)]),
                        'b': voc_xml([('dog', (1, 1, 40, 30), 0)], filename='b.jpg', size=None)}

def test_voc_basics(tmp_path):
    recs,vocab = read_voc(write_voc(tmp_path, good_voc()))
    assert vocab == ['cat', 'dog'] and [r.file.name for r in recs] == ['a.jpg', 'b.jpg']
    assert recs[0].boxes.tolist() == [[1, 2, 11, 7]] and recs[0].labels == ['cat']  # 1-based inclusive -> edges; difficult skipped
    assert recs[1].boxes.tolist() == [[0, 0, 40, 30]]  # no <size>: read from the image file
    recs,_ = read_voc(tmp_path, keep_difficult=True, one_based=False)
    assert recs[0].boxes.tolist() == [[2, 3, 11, 7], [21, 11, 40, 30]] and recs[0].labels == ['cat', 'dog']
    assert read_voc(tmp_path, vocab=['dog', 'cat', 'bird'])[1] == ['dog', 'cat', 'bird']

def test_voc_missing_split(tmp_path):
    write_voc(tmp_path, good_voc())
    with pytest.raises(FileNotFoundError, match=r"no split file '.*val.txt': this folder has splits \['train'\]"): read_voc(tmp_path, 'val')

BAD_VOC = [
    (lambda x: x.update(a=voc_xml([('cat', (43, 3, 45, 7), 0)])), "'{root}/Annotations/a.xml': object 0 ('cat'): box [42, 2, 45, 7] (ltrb) lies wholly outside the 40x30 image"),
    (lambda x: x.update(a=voc_xml([('cat', (5, 3, 4, 7), 0)])), "'{root}/Annotations/a.xml': object 0 ('cat'): box [4, 2, 4, 7] (ltrb) has zero or negative size (0 x 5)"),
    (lambda x: x.update(a=voc_xml([('cat', (2, 3, 11, 7), 0), ('', (2, 3, 11, 7), 0)])), "'{root}/Annotations/a.xml': object 1: no <name>"),
    (lambda x: x.update(a=voc_xml([('cat', (2, 3, 'x', 7), 0)])), "'{root}/Annotations/a.xml': object 0 ('cat'): no <bndbox> with numbers xmin, ymin, xmax, ymax"),
    (lambda x: x.update(a=voc_xml([('cow', (2, 3, 11, 7), 0)])), "'{root}/Annotations/a.xml': object 0: class 'cow' is not in vocab ['cat', 'dog']"),
    (lambda x: x.update(a='<annotation><object></annotation>'), "'{root}/Annotations/a.xml': XML does not parse (mismatched tag: line 1, column 22)"),
    (lambda x: x.update(a=voc_xml([], filename='gone.jpg')), "'{root}/Annotations/a.xml': image file '{root}/JPEGImages/gone.jpg' does not exist"),
]

@pytest.mark.parametrize('change,line', BAD_VOC, ids=[l.split(': ')[-1][:30] for _,l in BAD_VOC])
def test_voc_bad(tmp_path, change, line):
    xmls = good_voc(); change(xmls)
    root,line = write_voc(tmp_path, xmls),line.format(root=tmp_path)
    with pytest.raises(ValueError) as e: read_voc(root, vocab=['cat', 'dog'])
    assert str(e.value).startswith(f"'{root}' split 'train': 1 bad annotation(s):\n  {line}\n"), str(e.value)
    with pytest.warns(UserWarning) as w: recs,_ = read_voc(root, vocab=['cat', 'dog'], skip_bad=True)
    assert len(w) == 1 and line in str(w[0].message)
    assert [r.file.name for r in recs][-1] == 'b.jpg' and recs[-1].labels == ['dog']

def test_voc_missing_xml(tmp_path):
    root = write_voc(tmp_path, good_voc())
    (root/'ImageSets/Main/train.txt').write_text('a\nb\nzz\n')
    with pytest.raises(ValueError, match=r"Annotations/zz.xml': missing \(image id 'zz' is listed in the split\)"): read_voc(root)
    with pytest.warns(UserWarning, match='zz.xml'): assert len(read_voc(root, skip_bad=True)[0]) == 2
