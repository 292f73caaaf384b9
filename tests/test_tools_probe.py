"""The GPU diagnostics of `tools/` (`training_wait.py`, `handover_probe.py`, `step_times.py`) run on the GPU machine only; their parts that
decide what is measured are checked here, on the CPU: a wrong lever parser or a batch-dropping thread would report
numbers for something else."""
import time
from pathlib import Path
import numpy as np, pytest, torch

from helpers import load_tool


@pytest.fixture(scope='module')
def wait(): return load_tool('training_wait')


@pytest.fixture(scope='module')
def probe(): return load_tool('handover_probe')


def test_levers_parse_to_loader_keywords(wait):
    got = wait.parse_levers(['', 'hw_decoder_load=1.0', 'hw_decoder_load=1.0,num_threads=4', 'dtype=float16', 'decode_on=cpu'])
    assert got == {'defaults': {}, 'hw_decoder_load=1.0': {'hw_decoder_load': 1.0},
                   'hw_decoder_load=1.0,num_threads=4': {'hw_decoder_load': 1.0, 'num_threads': 4},
                   'dtype=float16': {'dtype': 'float16'}, 'decode_on=cpu': {'decode_on': 'cpu'}}
    assert isinstance(got['hw_decoder_load=1.0,num_threads=4']['num_threads'], int)


def test_step_times_skip_validation_batches(wait):
    "Validation batches (forward only) once pulled the 'synchronized step' median down to a third of a training step"
    cb = wait.StepTimes(); cb.before_fit(); cb.training = False
    for _ in range(3): cb.before_batch(); cb.after_batch()  # a counted batch would synchronize a GPU: none here
    assert cb.fetch == [] and cb.step == []


def test_threaded_keeps_every_batch_in_order(probe):
    assert list(probe.threaded(iter(range(50)), depth=2)) == list(range(50))
    assert list(probe.threaded(iter([]))) == []


def test_plain_loop_reads_both_batch_kinds(probe):
    "fastai's typed batch and the bare DALI iterator's list of dicts (its item index stands for the class)"
    from fastai.torch_core import TensorImage, TensorCategory
    x,y = probe.xy((TensorImage(torch.zeros(2, 3, 4, 4)), TensorCategory(torch.tensor([1, 2]))))
    assert type(x) is torch.Tensor and type(y) is torch.Tensor
    x,y = probe.xy([{'images': torch.zeros(2, 3, 4, 4), 'index': torch.tensor([[13], [4]])}])
    assert y.tolist() == [3, 4]


def test_ddp_bench_separates_the_loader_the_model_and_fastai():
    "Issue 16's DDP decomposition: the plain loop on a random batch and fed by the loader, each with fastai's model"
    ddp = load_tool('ddp_bench')
    flags = [tuple(extra) for _,extra in ddp.CASES]
    assert ('--synthetic', '--fastai-model') in flags and ('--plain-dali', '--fastai-model') in flags
    assert flags[-2:] == [(), ('--sync-bn',)]  # `compare` takes sync_bn's one-GPU number from the row before it
    theirs,plain = ddp.plain_model(True),ddp.plain_model(False)
    x = torch.zeros(2, 3, 64, 64)
    assert theirs.eval()(x).shape == plain.eval()(x).shape == (2, 10)
    assert type(theirs).__name__ == 'Sequential' and type(plain).__name__ == 'ResNet'  # fastai's body + head
    # trained as `Learner.fit` trains: every layer in training mode (create_vision_model leaves its body in eval mode)
    assert all(m.training for m in ddp.plain_model(True).modules()) and all(m.training for m in ddp.plain_model(False).modules())
    assert ddp.plain_model(False, arch='resnet18').layer1[0].__class__.__name__ == 'BasicBlock'  # `--arch`: the model asked for


def test_step_times_split_steps_inside_and_into_an_epoch():
    "Only training batches are stamped, and the step into an epoch's first batch (validation before it) is kept apart"
    st = load_tool('step_times')
    cb = st.Stamps(); cb.before_fit()
    for training,epoch,i in [(True, 0, 0), (True, 0, 1), (False, 0, 0), (True, 1, 0), (True, 1, 1), (True, 1, 2)]:
        cb.learn = type('L', (), dict(training=training, epoch=epoch, iter=i))()
        cb.before_batch(); cb.after_batch()
    assert [(e, i) for e,i,_ in cb.t] == [(e, i) for e,i,_ in cb.ends] == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    assert all(a[2] <= b[2] for a,b in zip(cb.t, cb.ends))  # a batch ends after it starts
    stamps = [(0, 0, 0.0), (0, 1, 0.010), (1, 0, 0.200), (1, 1, 0.210), (1, 2, 0.225)]
    inside,first = st.step_gaps(stamps, 0)
    assert [round(g) for g in inside] == [10, 10, 15] and [round(g) for g in first] == [190]
    assert st.step_gaps(stamps, 2) == ([pytest.approx(10), pytest.approx(15)], [])
    ends = [(0, 0, 0.008), (0, 1, 0.019), (1, 0, 0.203), (1, 1, 0.214), (1, 2, 0.230)]
    assert [round(g) for g in st.fetch_gaps(stamps, ends, 0)] == [2, 7, 11]  # inside an epoch only: not 0.019 → 0.200


def test_busy_cores_runs_a_decoding_process_and_stops_it(tmp_path):
    "`step_times --burn`'s load: another process decoding on DALI's CPU threads for as long as the block runs, then gone"
    from PIL import Image
    import numpy as np
    st = load_tool('step_times')
    for i in range(4): Image.fromarray(np.full((40, 60, 3), 60*i, dtype=np.uint8)).save(tmp_path/f'{i}.jpg')
    with st.busy_cores(tmp_path, 1) as proc:
        for _ in range(600):  # its progress lines keep coming (read by a thread, or a full pipe would stop it)
            if 'burner: 30 batches\n' in proc.lines: break
            time.sleep(0.1)
        assert proc.poll() is None and 'burner: 30 batches\n' in proc.lines
    assert proc.poll() is not None
    with pytest.raises(RuntimeError, match='the burner process stopped'):
        with st.busy_cores(tmp_path/'none', 1): pass


def test_parts_times_each_step_of_next_in_the_iterators_scope(probe, monkeypatch):
    "`handover_probe --parts`: the steps DALI's iterator takes, in its order and API scope, each timed"
    import contextlib
    calls = []
    class Pipe:
        @contextlib.contextmanager
        def _check_api_type_scope(self, kind): calls.append(('scope', kind.name)); yield
        def share_outputs(self): calls.append('share'); return [type('Out', (), {'as_tensor': lambda s: torch.zeros(2)})()]
        def release_outputs(self): calls.append('release')
        def schedule_run(self): calls.append('schedule')
    it = type('It', (), {'_pipes': [Pipe()], '__next__': lambda s: None})()
    monkeypatch.setattr(probe, 'queue_work', lambda *a, **k: calls.append('queue'))
    res = probe.parts(it, cpm=1., n=2)
    assert calls == 2*['queue', ('scope', 'ITERATOR'), 'share', 'release', 'schedule']
    assert [w.split()[0] for w in res.split(', ')] == ['share_outputs', 'from_dlpack', 'release_outputs', 'schedule_run', 'drop']


def test_step_times_gpu_columns_pair_the_same_batches():
    "The GPU's columns read the same pairs as the host's: the gap into the next batch inside an epoch, and each batch's own time"
    st = load_tool('step_times')
    stamps = [(0, 0, 0.0), (0, 1, 0.010), (1, 0, 0.200), (1, 1, 0.210)]
    ends = [(0, 0, 0.008), (0, 1, 0.019), (1, 0, 0.203), (1, 1, 0.214)]
    assert [round(g) for g in st.batch_times(stamps, ends, 0)] == [8, 9, 3, 4]
    assert [round(g) for g in st.batch_times(stamps, ends, 2)] == [3, 4]
    class At(float):  # a stand-in CUDA event: `elapsed_time` in milliseconds, as torch.cuda.Event's
        def elapsed_time(self, later): return 1e3*(later - self)
    ev = lambda xs: [(e, i, At(t)) for e,i,t in xs]
    assert st.fetch_gaps(ev(stamps), ev(ends), 0, st.gpu_ms) == pytest.approx(st.fetch_gaps(stamps, ends, 0))
    assert st.batch_times(ev(stamps), ev(ends), 1, st.gpu_ms) == pytest.approx(st.batch_times(stamps, ends, 1))


@pytest.fixture(scope='module')
def levers(): return load_tool('levers')


def test_fold_lever_reads_each_sample_through_the_same_map(levers, tmp_path):
    "The resize folded into the warp: the same crop and augmentation draws, read through the same map, in one resample"
    from helpers import make_coordinate_image, index_loader, source_maps
    files = [make_coordinate_image(tmp_path/f'{i}.png') for i in range(8)]
    make = lambda: index_loader(files, bs=8, size=32, train=True, seed=5, p_rotate=0.5, p_warp=0.3)
    (x,_),(xf,_) = next(iter(make())),next(iter(levers.folded(make())))
    ours,theirs = source_maps(xf),source_maps(x)
    assert np.abs(ours - theirs).max() < 0.3  # pixels
    assert np.abs(theirs - theirs[[1, 2, 3, 4, 5, 6, 7, 0]]).max() > 5  # the samples' maps differ: a wrong map would show
    with pytest.raises(ValueError, match='needs the keyword recipe'):
        from fastai.vision.augment import Resize
        levers.folded(index_loader(files, bs=8, item_tfms=Resize(16)))


def test_threaded_lever_yields_the_loaders_batches_in_order(levers, files):
    from helpers import index_loader
    dl = levers.OnThread(index_loader(files[:40], bs=8, seed=1))
    assert len(dl) == 5
    assert [y.tolist() for _,y in dl] == [y.tolist() for _,y in index_loader(files[:40], bs=8, seed=1)]


def test_take_ahead_lever_hands_over_the_batch_it_took(levers, files):
    "A batch taken ahead is the one the next `next()` yields; at the end of the epoch nothing more is taken"
    from helpers import index_loader
    dl,seen = levers.TakeAheadLoader(index_loader(files[:40], bs=8, train=True, seed=1)),[]
    for _,y in dl: seen.append(y.tolist()); dl.take_ahead()
    assert seen == [y.tolist() for _,y in index_loader(files[:40], bs=8, train=True, seed=1)] and len(seen) == 5
    dl.take_ahead()  # outside an epoch: nothing happens
    assert dl.running is None and dl.ahead is None


def test_adapter_overhead_times_the_loader_over_dalis_batches(tmp_path):
    "`tools/adapter_overhead.py`: the loader reads the replay of its own DALI batches (`len(dl)` an epoch), the bare side the same batches, and a batch leaves nothing in reference cycles"
    tool = load_tool('adapter_overhead')
    dl = tool.loader(tool.images(tmp_path, n=40, side=8), bs=8, size=8)
    bare = tool.replayed(dl)
    assert isinstance(dl._iterator(), tool.Replay) and dl._iterator().batches is bare.batches
    ours = list(dl)
    assert len(ours) == len(dl) == 5  # the replay's epoch, as DALI's
    assert all(torch.equal(x, b[0]['images']) for (x,_),b in zip(ours, bare.batches[1:] + bare.batches[:1]))  # its batches, in its order
    assert tool.cycles(dl, n=20)[0] == 0


def test_gpus_accuracy_reads_the_line_train_prints(tmp_path, capsys):
    "tools/gpus_accuracy.py compares `dali-fastai train`'s final accuracy and loss: its pattern must read the line `train` prints"
    from test_cli import image_folder
    from dali_fastai.cli import main
    main(['train', str(image_folder(tmp_path)), '--epochs', '1', '--size', '16', '--bs', '4', '--device', 'cpu', '--seed', '0'])
    out = capsys.readouterr().out
    m = load_tool('gpus_accuracy').DONE.search(out)
    assert m is not None, out
    assert 0 <= float(m['acc']) <= 1 and float(m['loss']) > 0


def test_ddp_bench_times_the_hosts_wait_for_each_training_batch(monkeypatch):
    "ddp_bench's LoaderWait: a training phase's host seconds between batches (validation's not counted); `paid` prints them a phase"
    from types import SimpleNamespace
    ddp = load_tool('ddp_bench')
    clock = iter([1.0, 1.5, 2.0, 2.25, 9.0, 9.5])
    monkeypatch.setattr(ddp.time, 'perf_counter', lambda: next(clock))
    cb = ddp.LoaderWait(); cb.learn = SimpleNamespace(training=True)
    cb.before_fit(); cb.before_train()
    cb.before_batch(); cb.after_batch()  # the first batch: nothing before it to wait after (reads 1.0 at its end)
    cb.before_batch(); cb.after_batch()  # 1.5 - 1.0, then its end at 2.0
    cb.before_batch()                    # 2.25 - 2.0
    cb.learn.training = False
    cb.before_batch(); cb.after_batch()  # validation: not read
    cb.learn.training = True; cb.before_train(); cb.before_batch(); cb.after_batch()
    assert cb.waits == [0.75, 0.]
    assert ddp.paid({'host waits for batches': [0.75, 0.], 'graph capture': None}, {}) == "; of which host waits for batches (each epoch) 0.75, 0.00 s"


def test_every_tool_compiles_on_this_python():
    "The tools that run only on the GPU machine (Python 3.12) are read by this one too: a 3.12-only construct (e.g. a backslash inside an f-string's braces) fails here, not on a GPU lease"
    import py_compile
    tools = sorted((Path(__file__).parent.parent/'tools').glob('*.py'))
    assert len(tools) > 10
    for t in tools: py_compile.compile(str(t), doraise=True)
