"""The `dali-fastai` command: a folder without valid/, --valid-pct, --pretrained with no network (one line, no traceback),
nothing heavy imported before the arguments are parsed, detection folders laid out otherwise, and errors in flags"""
import json, os, shutil, subprocess, sys
from inspect import signature
from pathlib import Path
from urllib.error import URLError

import numpy as np
import pytest
import torch
from PIL import Image

from dali_fastai import cli, training
from dali_fastai.layouts import dataloaders_for
from dali_fastai.loader import DaliDataLoader


def image_folder(root:Path, splits=('train', 'valid'), n:int=4)->Path:
    "`root/<split>/<class>/<i>.png`: 2 classes, `n` small PNGs each"
    for split in splits:
        for c,colour in (('dark', 40), ('light', 200)):
            (root/split/c).mkdir(parents=True)
            for i in range(n): Image.fromarray(np.full((8, 8, 3), colour + i, np.uint8)).save(root/split/c/f'{i}.png')
    return root


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    "File-check verdicts and torch's hub cache in the test's folder, not the user's"
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path/'xdg'))
    monkeypatch.setenv('TORCH_HOME', str(tmp_path/'torch'))


@pytest.fixture
def offline(monkeypatch):
    "torch.hub cannot reach the network (as on a machine without one); the package itself patches nothing"
    def unreachable(*args, **kwargs): raise URLError(OSError(101, 'Network is unreachable'))
    monkeypatch.setattr(torch.hub, 'urlopen', unreachable)


def spy(f, seen:dict):
    "A stand-in for `f` with its signature (the command checks flags against it) that records the keywords it is called with"
    def record(**kwargs): seen.update(kwargs)
    record.__signature__ = signature(f)
    return record


def test_pretrained_without_network_is_one_line_error(tmp_path, offline, capsys):
    data = image_folder(tmp_path/'data')
    with pytest.raises(SystemExit) as e:
        cli.main(['train', str(data), '--pretrained', '--device', 'cpu', '--epochs', '1', '--bs', '2', '--size', '16'])
    msg = e.value.code
    assert isinstance(msg, str), "sys.exit(message): exit status 1, the message on stderr"
    assert msg.startswith("dali-fastai train: error: the pretrained resnet18 weights could not be downloaded "
                          "(URLError: <urlopen error [Errno 101] Network is unreachable>)"), msg
    hub = tmp_path/'torch'/'hub'/'checkpoints'
    assert f"https://download.pytorch.org/models/resnet18-" in msg and f" in {hub} " in msg, msg
    assert '\n' not in msg and 'Traceback' not in capsys.readouterr().err


def test_pretrained_error_names_the_arch_file(tmp_path, offline):
    data = image_folder(tmp_path/'data')
    with pytest.raises(ConnectionError, match=r'resnet34 weights .* https://download\.pytorch\.org/models/resnet34-') as e:
        cli.train(data, arch='resnet34', pretrained=True, device='cpu', epochs=1, bs=2, size=16)
    assert isinstance(e.value.__cause__, URLError)  # the original error is kept for a debugger


def test_other_errors_are_not_called_network_errors(tmp_path, monkeypatch):
    "Without --pretrained nothing is downloaded, and an OSError of the model is not reworded as a download failure"
    data = image_folder(tmp_path/'data')
    def broken(*args, **kwargs): raise OSError('disk on fire')
    monkeypatch.setattr('fastai.vision.learner.vision_learner', broken)  # `train` imports it when it runs
    with pytest.raises(OSError, match='disk on fire') as e: cli.train(data, device='cpu', epochs=1, bs=2, size=16)
    assert not isinstance(e.value, ConnectionError)


def test_folder_without_valid_needs_valid_pct(tmp_path):
    data = image_folder(tmp_path/'data', splits=('train',))
    with pytest.raises(SystemExit) as e: cli.main(['train', str(data), '--device', 'cpu'])
    assert "has no 'valid' folder" in e.value.code and '--valid-pct' in e.value.code


def test_valid_pct_is_passed_through(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, 'train', spy(cli.train, seen))
    cli.main(['train', str(tmp_path), '--valid-pct', '0.3'])
    assert seen['valid_pct'] == 0.3
    seen.clear(); cli.main(['train', str(tmp_path)])
    assert 'valid_pct' not in seen and signature(cli.train).parameters['valid_pct'].default is None  # a folder with valid/ uses it


def test_hw_decoder_load_reaches_every_tasks_loaders(tmp_path, monkeypatch):
    "`--hw-decoder-load F` (the distributed docs' lever for a heavy model under DDP) is each task's loaders' `hw_decoder_load`; left out, their own default; out of range, the flag is named"
    data = image_folder(tmp_path/'data')
    made = []  # the learners the command built, not fitted: their loaders are what this test reads
    monkeypatch.setattr(training, 'fit_and_report', lambda learn, *args, **kwargs: made.append(learn))
    for task,where in (('classification', [str(data)]), ('detection', []), ('segmentation', [])):
        cli.main(['train', '--task', task, *where, '--device', 'cpu', '--size', '32', '--bs', '4', '--hw-decoder-load', '0'])
        assert made[-1].dls.train.hw_decoder_load == made[-1].dls.valid.hw_decoder_load == 0., task
    cli.main(['train', str(data), '--device', 'cpu', '--size', '32', '--bs', '4'])
    assert made[-1].dls.train.hw_decoder_load == signature(DaliDataLoader).parameters['hw_decoder_load'].default
    with pytest.raises(SystemExit, match=r'--hw-decoder-load must be a number from 0 to 1, got 1\.5'):
        cli.main(['train', str(data), '--device', 'cpu', '--hw-decoder-load', '1.5'])


def test_decode_on_reaches_every_tasks_loaders(tmp_path, monkeypatch):
    "`--decode-on cpu` is each task's loaders' `decode_on`; left out, the loaders' default 'auto'; another word, the flag's choices"
    data = image_folder(tmp_path/'data')
    made = []
    monkeypatch.setattr(training, 'fit_and_report', lambda learn, *args, **kwargs: made.append(learn))
    for task,where in (('classification', [str(data)]), ('detection', []), ('segmentation', [])):
        cli.main(['train', '--task', task, *where, '--device', 'cpu', '--size', '32', '--bs', '4', '--decode-on', 'cpu'])
        assert made[-1].dls.train.decode_on == made[-1].dls.valid.decode_on == 'cpu', task
    cli.main(['train', str(data), '--device', 'cpu', '--size', '32', '--bs', '4'])
    assert made[-1].dls.train.decode_on == 'auto'
    cli.main(['train', str(data), '--device', 'cpu', '--size', '32', '--bs', '4', '--decode-on', 'gpu'])
    assert made[-1].dls.train.decode_on == made[-1].dls.valid.decode_on == 'gpu'
    with pytest.raises(SystemExit): cli.main(['train', str(data), '--device', 'cpu', '--decode-on', 'host'])


def test_valid_pct_splits_at_random(tmp_path):
    data = image_folder(tmp_path/'data', splits=('train',), n=10)
    dls = dataloaders_for(data, valid_pct=0.25, bs=2, size=8, device='cpu', seed=0)
    assert (len(dls.train_ds), len(dls.valid_ds)) == (15, 5)
    assert set(dls.vocab) == {'dark', 'light'}


def test_valid_pct_overrides_valid_folder(tmp_path):
    data = image_folder(tmp_path/'data', n=10)
    dls = dataloaders_for(data, valid_pct=0.5, bs=2, size=8, device='cpu', seed=0)
    assert (len(dls.train_ds), len(dls.valid_ds)) == (10, 10)  # train/ split in two; valid/ unused
    assert all('/train/' in str(f) for f in dls.valid.items.files)


def test_help_says_valid_is_optional(capsys):
    with pytest.raises(SystemExit): cli.main(['train', '--help'])
    out = ' '.join(capsys.readouterr().out.split())
    assert 'valid/ is optional, but without it pass --valid-pct' in out
    assert '--valid-pct VALID_PCT hold out this share of the images at random' in out


def test_train_detection_from_the_command_line(tmp_path, capsys):
    "`--task detection` trains a detector on a COCO folder through DALI and ends with a COCO mAP line"
    pytest.importorskip('pycocotools', reason="the detector's mAP metric needs pycocotools (in the project's dev extras)")
    from dali_fastai.scenes import fashion_scenes
    scenes = fashion_scenes(tmp_path/'scenes', n_train=16, n_valid=8, size=96, progress=False)
    cli.main(['train', '--task', 'detection', str(scenes), '--device', 'cpu', '--epochs', '1', '--bs', '8', '--size', '64'])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith('done: 1 epoch of fcos on 16 images (cpu)') and '| map ' in last and '| map_50 ' in last
    with pytest.raises(SystemExit, match='--valid-pct and --pretrained are for classification'):
        cli.main(['train', '--task', 'detection', str(scenes), '--valid-pct', '0.2'])


def test_bench_detection_from_the_command_line(tmp_path, capsys, monkeypatch):
    "`bench --task detection` puts DALI's detection loader beside fastai's on the embedded scenes and prints the ratio"
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path))  # where the default scenes are written
    from dali_fastai.scenes import fashion_scenes
    scenes = fashion_scenes(tmp_path/'scenes', n_train=40, n_valid=4, size=64, progress=False)
    cli.main(['bench', '--task', 'detection', str(scenes), '--device', 'cpu', '--size', '32', '--bs', '4', '--batches', '1',
              '--warmup', '1', '--passes', '1', '--workers', '0'])  # fastai's workers forked beside DALI's threads can crash
    out = capsys.readouterr().out
    assert 'dali_fastai detection train' in out and 'fastai detection train' in out and "x fastai's" in out


HEAVY = {'torch', 'torchvision', 'fastai', 'nvidia'}

@pytest.mark.parametrize('code', ["from dali_fastai.cli import parser; parser().parse_args(['train', '--task', 'detection'])",
                                  "from dali_fastai.cli import main; main(['--help'])",
                                  "from dali_fastai.cli import main; main(['train', '--help'])",
                                  "from dali_fastai.cli import main; main(['train', '--bs', 'x'])"])
def test_parsing_imports_nothing_heavy(code):
    "`dali-fastai --help` (and a mistyped flag) answers before torch, fastai or DALI is imported: they take seconds"
    probe = f"import sys\ntry: {code}\nexcept SystemExit: pass\nprint(sorted({{m.split('.')[0] for m in sys.modules}} & {HEAVY!r}))"
    r = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == '[]', r.stdout


def test_help_texts(capsys):
    with pytest.raises(SystemExit): cli.main(['--help'])
    assert 'train a classifier, a detector or a segmenter' in capsys.readouterr().out
    with pytest.raises(SystemExit): cli.main(['shards', '--help'])
    usage = capsys.readouterr().out.split('\n\n')[0]
    assert (usage.count('SRC'), usage.count('DEST')) == (1, 1), usage
    with pytest.raises(SystemExit): cli.main(['train', '--help'])
    out = ' '.join(capsys.readouterr().out.split())
    for flag in ('--images DIR', '--valid-images DIR', '--train-json FILE', '--valid-json FILE', '--train-split NAME',
                 '--valid-split NAME', '--skip-bad'): assert flag in out, flag


@pytest.fixture(scope='module')
def scenes(tmp_path_factory):
    "The embedded scenes, small: COCO json, Pascal VOC XML and the images in JPEGImages/"
    from dali_fastai.scenes import fashion_scenes
    return fashion_scenes(tmp_path_factory.mktemp('scenes')/'scenes', n_train=16, n_valid=8, size=96, progress=False)


def coco2017(scenes:Path, root:Path)->Path:
    "The scenes laid out as COCO 2017 is: annotations/instances_{train,val}2017.json, images in train2017/ and val2017/"
    (root/'annotations').mkdir(parents=True)
    for split,name in (('train', 'train2017'), ('valid', 'val2017')):
        shutil.copy(scenes/'annotations'/f'{split}.json', root/'annotations'/f'instances_{name}.json')
        (root/name).mkdir()
        for f in (scenes/'JPEGImages').glob(f'{split}_*.jpg'): shutil.copy(f, root/name)
    return root


@pytest.fixture
def loaders_only(monkeypatch):
    "`fit_and_report` records the Learner's loaders instead of training: the command's loaders, without the minutes"
    seen = {}
    monkeypatch.setattr(training, 'fit_and_report', lambda learn, *args, **kwargs: seen.update(dls=learn.dls))
    return seen


def test_detection_folder_laid_out_as_coco2017(scenes, tmp_path, loaders_only):
    root = coco2017(scenes, tmp_path/'coco')
    with pytest.raises(SystemExit, match='neither a COCO folder .* pass --train-json and --valid-json'):
        cli.main(['train', '--task', 'detection', str(root)])
    with pytest.raises(SystemExit, match=r"no COCO json '.*annotations/valid.json': pass --valid-json, the file's path"):
        cli.main(['train', '--task', 'detection', str(root), '--train-json', 'annotations/instances_train2017.json'])
    jsons = ['--train-json', 'annotations/instances_train2017.json', '--valid-json', 'annotations/instances_val2017.json']
    with pytest.raises(SystemExit) as e: cli.main(['train', '--task', 'detection', str(root), *jsons, '--device', 'cpu'])
    assert 'pass --images DIR (and --valid-images DIR), the folder(s)' in e.value.code, e.value.code
    with pytest.raises(SystemExit, match=r"no image folder '.*val2017x': pass --valid-images DIR, a folder under"):
        cli.main(['train', '--task', 'detection', str(root), *jsons, '--images', 'train2017', '--valid-images', 'val2017x'])
    cli.main(['train', '--task', 'detection', str(root), *jsons, '--images', 'train2017', '--valid-images', 'val2017',
              '--bs', '8', '--size', '64', '--device', 'cpu'])
    dls = loaders_only['dls']
    assert (len(dls.train_ds), len(dls.valid_ds)) == (16, 8)
    assert {f.parent.name for f in dls.train.items.files} == {'train2017'}
    assert {f.parent.name for f in dls.valid.items.files} == {'val2017'}


def test_detection_voc_split_names(scenes, tmp_path, loaders_only):
    voc = tmp_path/'voc'
    shutil.copytree(scenes, voc, ignore=shutil.ignore_patterns('annotations'))  # Pascal VOC only
    (voc/'ImageSets'/'Main'/'val.txt').rename(voc/'ImageSets'/'Main'/'test.txt')
    with pytest.raises(SystemExit, match="no split file"): cli.main(['train', '--task', 'detection', str(voc)])
    cli.main(['train', '--task', 'detection', str(voc), '--valid-split', 'test', '--bs', '8', '--size', '64', '--device', 'cpu'])
    assert len(loaders_only['dls'].valid_ds) == 8
    with pytest.raises(SystemExit, match='--box-crop, --train-split: for --task detection only'):
        cli.main(['train', str(voc), '--box-crop', '--train-split', 'train'])


def test_errors_name_flags_not_arguments(scenes):
    "A batch larger than the training set: the message says --bs, not bs="
    with pytest.raises(SystemExit) as e: cli.main(['train', '--task', 'detection', str(scenes), '--bs', '32', '--device', 'cpu'])
    msg = e.value.code
    assert '--bs 32' in msg and 'bs=' not in msg, msg


def test_bad_annotation_suggests_skip_bad_flag(scenes, tmp_path, loaders_only):
    "A box of zero width stops the command with --skip-bad as the way on (not skip_bad=True), and --skip-bad goes on"
    coco = tmp_path/'coco'
    shutil.copytree(scenes, coco, ignore=shutil.ignore_patterns('Annotations', 'ImageSets'))
    d = json.loads((coco/'annotations'/'train.json').read_text())
    d['annotations'][0]['bbox'][2] = 0
    (coco/'annotations'/'train.json').write_text(json.dumps(d))
    args = ['train', '--task', 'detection', str(coco), '--bs', '8', '--size', '64', '--device', 'cpu']
    with pytest.raises(SystemExit) as e: cli.main(args)
    assert 'pass --skip-bad to skip them' in e.value.code and 'skip_bad' not in e.value.code, e.value.code
    with pytest.warns(UserWarning, match='skipped 1 bad annotation'): cli.main([*args, '--skip-bad'])
    assert len(loaders_only['dls'].train_ds) == 16


def test_bad_image_suggests_skip_bad_flag(tmp_path, loaders_only):
    data = image_folder(tmp_path/'data')
    (data/'train'/'dark'/'broken.png').write_bytes(b'not an image')
    args = ['train', str(data), '--bs', '2', '--size', '8', '--device', 'cpu']
    with pytest.raises(SystemExit) as e: cli.main(args)
    assert 'broken.png' in e.value.code and 'pass --skip-bad' in e.value.code and 'skip_bad' not in e.value.code, e.value.code
    with pytest.warns(UserWarning, match='broken.png'): cli.main([*args, '--skip-bad'])
    assert len(loaders_only['dls'].train_ds) == 8


def test_demo_trains_at_the_embedded_datas_size():
    "`make demo` trains on the embedded Fashion-MNIST sample at its own size: the command's default (64 px) takes ~5x longer"
    from dali_fastai.datasets import fashion_mnist_arrays
    recipe = (Path(__file__).resolve().parents[1]/'Makefile').read_text().split('\ndemo:')[1].split('\n\n')[0]
    cmd = next(l for l in recipe.splitlines() if l.strip().startswith('$(BIN)/dali-fastai train'))
    args = cli.parser().parse_args(cmd.strip().rstrip('; \\').split()[1:])
    assert (args.path, args.size, args.device) == (None, fashion_mnist_arrays()['train_x'].shape[-1], 'cpu')
    assert 'took' in recipe and 'venv ready in' in recipe, "each step says how long it took"


def test_bench_step_and_peers_reach_their_functions(tmp_path, monkeypatch):
    "`bench --task step` runs the step bench (archs, batch sizes) and the tasks' rows; `--peers` reaches the peers"
    import dali_fastai.stepbench as sb, dali_fastai.bench as bm, dali_fastai.measure as ms, dali_fastai.taskbench as tb, dali_fastai.peers as pe
    calls = []
    monkeypatch.setattr(sb, 'step_bench', lambda *a, **k: calls.append(('step', a, k)) or {'rows': {}})
    monkeypatch.setattr(sb, 'task_step_bench', lambda t, **k: calls.append((t, k)) or {'rows': {}})
    cli.main(['bench', '--task', 'step', '--archs', 'resnet18', '--device', 'cpu', '--out', str(tmp_path)])
    assert calls[0][1][1:4] == (('resnet18',), (64, 256), 224) and [c[0] for c in calls[1:]] == ['segmentation', 'detection', 'retinanet']
    assert (tmp_path/'step.json').is_file()
    monkeypatch.setattr(bm, 'bench', lambda *a, **k: calls.append(('bench', k)) or {})
    monkeypatch.setattr(ms, 'bench_images', lambda **k: tmp_path)
    cli.main(['bench', '--peers', '--device', 'cpu'])
    assert calls[-1][0] == 'bench' and calls[-1][1]['peers'] is True
    monkeypatch.setattr(tb, 'segmentation_bench', lambda *a, **k: {})
    monkeypatch.setattr(pe, 'segmentation_peers', lambda *a, **k: calls.append(('seg peers', a, {n: k[n] for n in ('size', 'bs', 'device')})) or {})
    cli.main(['bench', '--task', 'segmentation', '--peers', '--device', 'cpu'])
    assert calls[-1] == ('seg peers', (None,), {'size': 128, 'bs': 64, 'device': 'cpu'})


def _tiny_classifier(dls, cbs, metric, size):
    "A `CAPTURE_MODELS` learner small enough for the CPU: one convolution, then the classes"
    from fastai.learner import Learner
    from fastai.losses import CrossEntropyLossFlat
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, dls.c))
    return Learner(dls, model, loss_func=CrossEntropyLossFlat(), cbs=cbs)


def test_bench_capture_on_the_cpu(tmp_path, capsys, monkeypatch):
    "`bench --task capture` end to end on the CPU: a row a model and batch size, eager beside graph, whose capture the CPU refuses (the row says why), the ratio of the rates in the JSON and the table; a model whose module does not import is skipped, named"
    import dali_fastai.capturebench as cb
    monkeypatch.setattr(cb, 'CAPTURE_MODELS', {**cb.CAPTURE_MODELS, 'tiny': ('classification', _tiny_classifier, None),
                                                'absent': ('classification', _tiny_classifier, 'no_such_module_h39')})
    cli.main(['bench', str(image_folder(tmp_path/'data', n=8)), '--task', 'capture', '--models', 'tiny,absent', '--bs', '4',
              '--size', '32', '--device', 'cpu', '--batches', '2', '--warmup', '1', '--passes', '2', '--out', str(tmp_path/'out')])
    res = json.loads((tmp_path/'out'/'capture.json').read_text())
    assert list(res['rows']) == ['tiny bs 4'] and 'pip install no_such_module_h39' in res['skipped']['absent']
    r = res['rows']['tiny bs 4']
    assert r['fell back'] == 'FastStep(graph=True): the model is not on a CUDA device; training goes on with the uncaptured fast step'
    assert r['graph/eager'] == pytest.approx(r['graph'] / r['eager']) and [len(f) for f in r['fits'].values()] == [2, 2]
    assert r['capture s'] == pytest.approx(r['start s']['graph'] - r['start s']['eager'])
    table = capsys.readouterr().out.split('FastStep(graph=False) (eager) and FastStep(graph=True) (graph), CPU')[1].splitlines()
    assert table[1].split()[:6] == ['model', 'bs', 'eager', 'graph', 'g/e', 'start']
    assert table[2].split()[:5] == ['tiny', '4', f"{r['eager']:.0f}", f"{r['graph']:.0f}", f"{r['graph/eager']:.2f}"]
    assert table[2].endswith('  the model is not on a CUDA device') and table[3].startswith('absent: skipped, no_such_module_h39')
    assert table[-2].startswith('graph slower than eager: ') and table[-1] == f"(1 rows in {res['seconds']:.0f} s)"
    assert len(table) == 2 + 1 + 1 + 1 + 1 + 1  # header, row, skipped, loader, verdict, time


def test_train_flags_state_each_tasks_defaults():
    "The command passes only the flags set, so the help's defaults must be those of `train`, `train_detection`, `train_segmentation`"
    helps = {a.dest: a.help for a in cli.parser()._subparsers._group_actions[0].choices['train']._actions}
    fns = {'default': cli.train, 'detection': cli.train_detection, 'segmentation': cli.train_segmentation}
    for k in ('epochs', 'size', 'bs', 'lr'):
        stated = {t.strip(): v for part in helps[k].split('(')[-1].rstrip(')').split(';')
                  for ts,v in [part.split(':')] for t in ts.split(',')}
        assert {t: float(v) for t,v in stated.items()} == {t: signature(f).parameters[k].default for t,f in fns.items()}, (k, stated)


def test_train_passes_only_the_flags_set(monkeypatch):
    "Unset flags leave each task's own defaults (arch included); a flag of another task is an error naming it"
    seen = {name: {} for name in ('train', 'train_detection', 'train_segmentation')}
    for name in seen: monkeypatch.setattr(cli, name, spy(getattr(cli, name), seen[name]))
    cli.main(['train', '--task', 'segmentation', '--bs', '4'])
    assert seen['train_segmentation'] == {'bs': 4}
    cli.main(['train', '--task', 'detection', '--box-crop'])
    assert seen['train_detection'] == {'box_crop': True}
    with pytest.raises(SystemExit, match='--box-crop: for --task detection only'): cli.main(['train', '--task', 'segmentation', '--box-crop'])
    with pytest.raises(SystemExit, match='--valid-pct and --pretrained are for classification'):
        cli.main(['train', '--task', 'segmentation', '--pretrained'])


def test_bench_accuracy_at_fastais_batch_size(tmp_path, monkeypatch):
    "`bench --task accuracy` trains at fastai's default bs 64 unless `--bs` says otherwise"
    import dali_fastai.taskbench as tb
    calls = []
    monkeypatch.setattr(tb, 'time_to_accuracy', lambda *a, **k: calls.append(k) or {})
    cli.main(['bench', str(tmp_path), '--task', 'accuracy', '--device', 'cpu', '--out', str(tmp_path)])
    cli.main(['bench', str(tmp_path), '--task', 'accuracy', '--device', 'cpu', '--bs', '128', '--out', str(tmp_path)])
    assert [k['bs'] for k in calls] == [64, 128]


def test_bench_scale_reaches_scale_bench(tmp_path, monkeypatch):
    "`bench --scale [--sizes A,B] PATH --out OUT` runs `scale_bench` on those sizes (default: 10000,100000,1280000) under PATH and writes its rows to OUT/scale.json (its measurements, each in a fresh process: nbs/08d_taskbench.ipynb)"
    import dali_fastai.taskbench as tb
    calls,rows = [],[dict(n=1000, how='from_webdataset', state='cold', seconds=0.5, rss_gib=0.9, added_gib=0., items=2000)]
    monkeypatch.setattr(tb, 'scale_bench', lambda *a, **k: calls.append((a, k)) or rows)
    cli.main(['bench', '--scale', '--sizes', '1000,20000', str(tmp_path/'scale'), '--out', str(tmp_path/'out')])
    cli.main(['bench', '--scale', str(tmp_path/'scale'), '--out', str(tmp_path/'out')])
    assert calls == [(((1000, 20000), str(tmp_path/'scale')), {}), (((10_000, 100_000, 1_280_000), str(tmp_path/'scale')), {})]
    assert json.loads((tmp_path/'out'/'scale.json').read_text()) == rows


def test_shards_name_every_bad_image_and_skip_them(tmp_path, capsys):
    "`dali-fastai shards` names all the files it cannot write (not the first alone), before writing; --skip-bad leaves them out"
    data = image_folder(tmp_path/'data')
    bad = ['a.png', 'b.png', 'c.png']
    for name in bad: (data/'train'/'dark'/name).write_bytes(b'not an image')
    args = ['shards', str(data), str(tmp_path/'out')]
    with pytest.raises(SystemExit) as e: cli.main(args)
    assert all(f"train/dark/{n}' (" in e.value.code for n in bad) and 'pass --skip-bad' in e.value.code, e.value.code
    assert 'skip_bad' not in e.value.code and not (tmp_path/'out').exists(), e.value.code
    capsys.readouterr()
    with pytest.warns(UserWarning, match="leaving out 3 file"): cli.main([*args, '--skip-bad', '--check'])
    assert capsys.readouterr().out.splitlines()[-1] == f"checked 16 samples in {tmp_path/'out'}: all readable"  # the 16 good ones


# ---------------------------------------------------------------- FastStep, and several processes (torchrun)

def _env()->dict:
    "This process's environment, this checkout's package first on PYTHONPATH (torchrun's processes inherit it), one thread a process"
    path = os.pathsep.join([str(Path(__file__).resolve().parents[1]), *filter(None, [os.environ.get('PYTHONPATH')])])
    return {**os.environ, 'PYTHONPATH': path, 'OMP_NUM_THREADS': '1'}


def _command(*args, timeout=420)->subprocess.CompletedProcess:
    "`dali-fastai` with `args` in a new process (`_env`)"
    env = _env()
    return subprocess.run([sys.executable, '-c', 'from dali_fastai.cli import main; main()', *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_train_flags_for_fast_step_reach_train(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, 'train', spy(cli.train, seen))
    cli.main(['train', '--fast-step', '--graph'])
    assert seen == {'fast_step': True, 'graph': True}, "the launch flags (--gpus ...) are torchrun's, not train's"


def test_train_with_fast_step(tmp_path, capsys):
    "`--fast-step` (`fast_step=True`): FastStep (its default, graph='auto') among the callbacks, PyTorch's fused step in place, the usual last line"
    from dali_fastai.faststep import FastStep
    learn = cli.train(image_folder(tmp_path/'data', n=8), epochs=1, size=16, bs=4, device='cpu', seed=0, progress=False, fast_step=True)
    assert any(isinstance(cb, FastStep) and cb.graph == 'auto' for cb in learn.cbs)  # FastStep's default: captured where faster
    assert type(learn.opt).__name__ == 'FastOptimizer'
    assert capsys.readouterr().out.splitlines()[-1].startswith('done: 1 epoch of resnet18 on 16 images (cpu) in ')


def test_train_on_two_processes_on_the_cpu():
    """`dali-fastai train --gpus 2 --device cpu`: torchrun, 2 gloo processes, DDP; the first process alone prints, with the
    metrics. `--arch squeezenet1_1`: resnet18's epoch of the embedded set took 31 s of the test's 49 on 2 cores, this
    model's 4 (`test_train_as_two_nodes` trains resnet18 in 2 processes)"""
    r = _command('train', '--gpus', '2', '--device', 'cpu', '--epochs', '1', '--size', '28', '--arch', 'squeezenet1_1')
    assert r.returncode == 0, r.stderr[-3000:]
    done = [l for l in r.stdout.splitlines() if l.startswith('done: ')]
    assert len(done) == 1 and done[0].startswith('done: 1 epoch of squeezenet1_1 on 3000 images (cpu, 2 processes) in '), r.stdout
    assert 'valid_loss' in done[0] and 'accuracy 0.' in done[0]
    assert sum(l.startswith('loaders (') for l in r.stdout.splitlines()) == 1


def test_train_as_two_nodes(tmp_path):
    "Two machines as torchrun sees them, here two commands on this host: `--nnodes 2 --node-rank 0|1 --master-addr`"
    import socket
    data = image_folder(tmp_path/'data', n=8)
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    env = _env()
    nodes = [subprocess.Popen([sys.executable, '-c', 'from dali_fastai.cli import main; main()', 'train', str(data),
                               '--gpus', '1', '--nnodes', '2', '--node-rank', str(k), '--master-addr', '127.0.0.1',
                               '--master-port', str(port), '--device', 'cpu', '--epochs', '1', '--size', '16', '--bs', '2'],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for k in range(2)]
    try: outs = [n.communicate(timeout=300) for n in nodes]
    finally:
        for n in nodes: n.kill()
    assert all(n.returncode == 0 for n in nodes), '\n'.join(err[-2000:] for _,err in outs)
    assert 'done: 1 epoch of resnet18 on 16 images (cpu, 2 processes) in ' in outs[0][0], outs[0][0]
    assert 'done: ' not in outs[1][0], "rank 0 alone prints"


@pytest.mark.parametrize('args,msg', [
    (['--gpus', '2', '--task', 'detection', '--device', 'cpu'], '--gpus 2: several processes train classification only'),
    (['--gpus', '1', '--nnodes', '2', '--device', 'cpu'], '--nnodes 2 needs --master-addr'),
    (['--gpus', '2', '--nnodes', '2', '--node-rank', '2', '--master-addr', 'a', '--device', 'cpu'], '--node-rank 2 must be in 0..1'),
], ids=['detection', 'no-master-addr', 'node-rank'])
def test_launch_errors_name_flags(args, msg):
    with pytest.raises(SystemExit, match=msg): cli.main(['train', *args])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for a machine without a GPU")
def test_gpus_without_a_gpu_says_device_cpu():
    with pytest.raises(SystemExit, match=r'--gpus 2 but PyTorch sees no GPU: pass --device cpu'): cli.main(['train', '--gpus', '2'])


def test_gpus_without_accelerate_says_which_extra(monkeypatch):
    "fastai's distrib_ctx needs accelerate: said once, before any process starts, with the extra that brings it"
    import importlib.util
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None if name == 'accelerate' else find(name, *a))
    with pytest.raises(SystemExit, match=r"--gpus 2: fastai's distrib_ctx needs accelerate.*dali-fastai\[ddp\]"):
        cli.main(['train', '--gpus', '2', '--device', 'cpu'])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="dali-fastai train --gpus 2: needs 2 GPUs (the lead's GPU machine)")
def test_train_on_two_gpus_with_the_graph():
    "`dali-fastai train --gpus 2 --graph`: NCCL, one GPU a process, the model captured (no fallback message), one last line"
    r = _command('train', '--gpus', '2', '--graph', '--epochs', '3', '--size', '28')
    assert r.returncode == 0, r.stderr[-3000:]
    done = [l for l in r.stdout.splitlines() if l.startswith('done: ')]
    assert len(done) == 1 and ', 2 processes) in ' in done[0] and 'cuda' in done[0], r.stdout
    assert 'FastStep(graph=True):' not in r.stderr, r.stderr[-3000:]
    assert float(done[0].split('accuracy ')[1].split()[0]) > 0.3, done[0]  # 10 classes: chance is 0.1


def test_session_bench_runs_the_seeds_asked_for(monkeypatch, tmp_path):
    "`bench --task session --seeds 0,1` runs a session a seed and variant (the README's row); a bad list names the flag"
    import dali_fastai.sessionbench as sessionbench
    asked = []
    monkeypatch.setattr(sessionbench, 'session_bench', lambda root, variants, seeds, **kw: asked.append((variants, seeds, kw)) or {})
    cli.main(['bench', '--task', 'session', '--seeds', '0,1', '--device', 'cpu', '--out', str(tmp_path)])
    assert asked[-1][1] == (0, 1) and asked[-1][0] == sessionbench.VARIANTS and asked[-1][2]['epochs'] == 3
    cli.main(['bench', '--task', 'session', '--device', 'cpu', '--out', str(tmp_path)])
    assert asked[-1][1] == (0,)
    with pytest.raises(SystemExit, match=r"--seeds '0,x': the seeds are whole numbers separated by commas, e\.g\. 0,1"):
        cli.main(['bench', '--task', 'session', '--seeds', '0,x', '--device', 'cpu', '--out', str(tmp_path)])
