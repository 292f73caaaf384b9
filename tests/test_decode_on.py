"""`decode_on='cpu'`: a GPU loader's JPEGs decoded on DALI's CPU threads and handed to the GPU, built while nvImageCodec
sees only its CPU extensions (`cpu_codecs`), with no GPU decoder kept for the process; `decode_on='auto'` (the default):
there until the host has waited for them longer than the GPU decoder's start costs, then on the GPU."""
import math, os, subprocess, sys, time
from pathlib import Path
from contextlib import contextmanager
import numpy as np
import pytest
import torch
from PIL import Image
from helpers import index_loader, epoch_items, needs_gpu
from dali_fastai.loader import DaliDataLoader, ImageItems
from dali_fastai.pipeline import _KEPT, release_decoders


def test_decode_on_reaches_every_pipeline_and_keeps_no_decoder(files, monkeypatch):
    "On DALI's CPU threads: every pipeline's recipe is told so (shards too), and no GPU decoder is kept for the process"
    import dali_fastai.loader as loader
    kept,told,codecs = [],[],[]
    monkeypatch.setattr(loader, 'keep_decoder', lambda device_id, load: kept.append(load))
    @contextmanager
    def recorded(): codecs.append('entered'); yield
    monkeypatch.setattr(loader, 'cpu_codecs', recorded)
    dl = index_loader(files[:8], 2, seed=0, decode_on='cpu')
    build = dl.recipe.build
    monkeypatch.setattr(dl.recipe, 'build', lambda *a, **kw: told.append(kw['decode_on']) or build(*a, **kw))
    epoch_items(dl)
    epoch_items(dl.shard(1, 2))
    assert told == ['cpu', 'cpu'], "the loader's setting reaches its pipeline's decoders, shard or not"
    assert kept == [], "no GPU decoder kept beside pipelines that decode on the CPU"
    assert codecs == ['entered', 'entered'], "each build with nvImageCodec shown its CPU extensions only"
    epoch_items(index_loader(files[:8], 2, seed=0, decode_on='gpu'))
    assert len(kept) == 1, "decoding on the GPU: the process's decoder is kept"


def test_decode_on_is_checked_by_name(files):
    with pytest.raises(ValueError, match="decode_on must be 'gpu', 'cpu' or 'auto', got 'CPU'"): index_loader(files[:4], 2, decode_on='CPU')


def test_the_environment_is_left_as_it_was(files):
    "nvImageCodec's extension folder is set only while a pipeline builds"
    assert 'NVIMGCODEC_EXTENSIONS_PATH' not in os.environ
    epoch_items(index_loader(files[:4], 2, seed=0, decode_on='cpu'))
    assert 'NVIMGCODEC_EXTENSIONS_PATH' not in os.environ


def _told(dl, monkeypatch)->list:
    "Where each of `dl`'s builds was told to decode, in order"
    told,build = [],dl.recipe.build
    monkeypatch.setattr(dl.recipe, 'build', lambda *a, **kw: told.append(kw['decode_on']) or build(*a, **kw))
    return told


def _switch_costs(monkeypatch, secs:float):
    "What the loaders are told a GPU decoder's start costs (on DALI's CPU backend, where they run here, it is `inf`: no count)"
    import dali_fastai.loader as loader
    monkeypatch.setattr(loader, 'gpu_decoder_cost', lambda device_id, ranks_here: secs)


def _every_item_once(dl, n:int, epochs:int):
    for _ in range(epochs): assert sorted(sum(epoch_items(dl), [])) == list(range(n)), "every item once an epoch"


def test_auto_moves_to_the_gpu_once_the_waits_have_paid_its_start(files, monkeypatch):
    "The default: DALI's CPU threads while the host's waits for them cost less than the GPU decoder's start; from the next epoch on, the GPU"
    dl = index_loader(files[:12], 3, train=True, seed=0)
    told = _told(dl, monkeypatch)
    assert (dl.decode_on, dl.decoding) == ('auto', 'cpu')
    _switch_costs(monkeypatch, 1e9)  # not worth it yet
    _every_item_once(dl, 12, 3)
    assert told == ['cpu'] and dl._source.waited > 0, "one build, on the CPU's threads, its waits counted"
    _switch_costs(monkeypatch, 1e-9)  # the waits have paid for the start
    _every_item_once(dl, 12, 2)
    assert (told, dl.decoding, dl._source.builds) == (['cpu', 'gpu'], 'gpu', 2), "rebuilt once, at an epoch's start"
    assert dl._source.settled and not dl._source.time_waits, "epochs too short for a trial: settled, no clock read"


def _paced(monkeypatch, batches:int=1):
    "Passes of `batches` timed batches or more give their loader's pace (the real threshold is for epochs of many batches)"
    import dali_fastai.epoch as epoch
    monkeypatch.setattr(epoch, 'PACE_BATCHES', batches)


def _moved(files, monkeypatch)->tuple:
    "A loader on trial on the GPU's decoders after one epoch on the CPU's, the builds' decoders, and its CPU's pace"
    _paced(monkeypatch)
    dl = index_loader(files[:12], 3, train=True, seed=0)
    told = _told(dl, monkeypatch)
    _switch_costs(monkeypatch, 1e9)
    _every_item_once(dl, 12, 1)
    cpu = dl._source.pace
    assert cpu is not None and cpu > 0, "a whole pass gives its pace"
    _switch_costs(monkeypatch, 1e-9)
    _every_item_once(dl, 12, 1)  # moved at its start
    assert (dl.decoding, dl._source.trial, dl._source.paces, dl._source.settled) == ('gpu', 'gpu', {'cpu': cpu}, False), "on trial"
    return dl,told,cpu


def test_an_epoch_on_the_gpus_decoders_slower_than_on_the_cpus_goes_back_for_good(files, monkeypatch):
    "A step that keeps the GPU busy makes the host wait too: the move is tried for one epoch, checked against an epoch on the CPU's right after it, and undone"
    dl,told,cpu = _moved(files, monkeypatch)
    dl._source.pace = cpu*1.5  # as if the GPU's decoders had slowed the step
    _every_item_once(dl, 12, 1)
    assert (dl.decoding, dl._source.trial) == ('cpu', 'cpu'), "an epoch on the CPU's again, to compare next to it"
    dl._source.pace = cpu  # as fast as before the move
    _every_item_once(dl, 12, 2)
    assert (told, dl.decoding, dl._source.settled) == (['cpu', 'gpu', 'cpu'], 'cpu', True), "back on the CPU's threads, and there for good"
    assert dl._source.paces == {'cpu': cpu, 'gpu': cpu*1.5} and not dl._source.time_waits, "no clock read once settled"


def test_a_trial_slower_than_an_older_pace_but_not_than_the_next_keeps_the_gpus(files, monkeypatch):
    "The CPU's pace before the move may come from another step (a frozen fit, then `unfreeze`): measured next to the trial it is as slow, so the GPU's come back"
    dl,told,cpu = _moved(files, monkeypatch)
    dl._source.pace = cpu*1.5
    _every_item_once(dl, 12, 1)
    dl._source.pace = cpu*1.5  # the new step is that slow on the CPU's decoders too
    _every_item_once(dl, 12, 2)
    assert (told, dl.decoding, dl._source.settled) == (['cpu', 'gpu', 'cpu', 'gpu'], 'gpu', True)


def test_an_epoch_on_the_gpus_decoders_as_fast_or_faster_stays_there(files, monkeypatch):
    for gpu_pace in (0.5, 1.04):  # faster, or slower within the margin (`TRIAL_MARGIN`)
        dl,told,cpu = _moved(files, monkeypatch)
        dl._source.pace = cpu*gpu_pace
        _every_item_once(dl, 12, 2)
        assert (told, dl.decoding, dl._source.settled) == (['cpu', 'gpu'], 'gpu', True)


def test_an_abandoned_trial_epoch_leaves_the_trial_open(files, monkeypatch):
    "`lr_find` right after the move reads part of an epoch, which gives no pace: the next whole one decides"
    dl,told,cpu = _moved(files, monkeypatch)
    dl._source.pace = None
    batches = iter(dl); next(batches); del batches
    assert (dl.decoding, dl._source.trial, dl._source.settled) == ('gpu', 'gpu', False)
    dl._source.pace = cpu*0.5
    _every_item_once(dl, 12, 2)
    assert (dl.decoding, dl._source.settled) == ('gpu', True)


def test_an_epoch_too_short_for_a_pace_moves_without_a_trial(files, monkeypatch):
    _switch_costs(monkeypatch, 1e-9)
    dl = index_loader(files[:12], 3, train=True, seed=0)  # 4 batches: a second half of 2, under PACE_BATCHES
    _every_item_once(dl, 12, 2)
    assert (dl.decoding, dl._source.trial, dl._source.settled, dl._source.time_waits) == ('gpu', None, True, False)


def test_the_trial_is_saved_with_the_loader(files, monkeypatch):
    "A loader resumed between the move and the trial's verdict still tries, with the saved paces"
    dl,told,cpu = _moved(files, monkeypatch)
    dl._source.pace = cpu*2
    state = dl.state_dict()
    assert (state['decoding'], state['trial'], state['paces'], state['settled']) == ('gpu', 'gpu', {'cpu': cpu}, False)
    fresh = index_loader(files[:12], 3, train=True, seed=0)
    fresh.load_state_dict(state)
    assert (fresh.decoding, fresh._source.paces, fresh._source.pace) == ('gpu', {'cpu': cpu}, cpu*2)
    _every_item_once(fresh, 12, 1)  # the saved DALI epoch, resumed on the graph it came from: no choice made
    fresh._source.pace = cpu*2
    _every_item_once(fresh, 12, 1)
    assert (fresh.decoding, fresh._source.trial) == ('cpu', 'cpu'), "the trial went on as the saved loader's would have"


def test_a_loader_that_decodes_where_it_is_told_never_moves(files, monkeypatch):
    _switch_costs(monkeypatch, 1e-9)
    for where in ('cpu', 'gpu'):
        dl = index_loader(files[:8], 2, seed=0, decode_on=where)
        told = _told(dl, monkeypatch)
        _every_item_once(dl, 8, 3)
        assert (told, dl._source.waited) == ([where], 0.), "built once, no clock read"


def test_get_preds_copy_and_resume_keep_the_choice(files, monkeypatch):
    "The validation loader's copy (`get_preds`) shares its pipeline and its choice; a resumed loader decodes where the saved one did"
    _switch_costs(monkeypatch, 1e-9)
    dl = index_loader(files[:8], 2, seed=0)
    _every_item_once(dl, 8, 2)
    copy = dl.new()
    assert copy.decoding == 'gpu' and copy._source is dl._source
    _every_item_once(copy, 8, 1)
    assert dl._source.builds == 2, "the copy built nothing"
    state = dl.state_dict()
    assert state['decoding'] == 'gpu' and state['waited'] == dl._source.waited > 0
    fresh = index_loader(files[:8], 2, seed=0)
    fresh.load_state_dict(state)
    assert fresh.decoding == 'gpu'


def test_a_resumed_epoch_keeps_its_checkpoints_graph(files, monkeypatch):
    "A state saved mid-epoch on the CPU's decoders resumes there, whatever the waits say then; a loader told to decode elsewhere says so"
    import dali_fastai.loader as loader
    _switch_costs(monkeypatch, 1e9)
    dl = index_loader(files[:12], 2, train=True, seed=0)
    _every_item_once(dl, 12, 2)
    batches = iter(dl); next(batches)
    state = dl.state_dict()
    assert (state['decoding'], state['taken']) == ('cpu', 1)
    _switch_costs(monkeypatch, 1e-9)  # the waits would pay now: not in the middle of the saved epoch
    fresh = index_loader(files[:12], 2, train=True, seed=0)
    fresh.load_state_dict(state)
    told = _told(fresh, monkeypatch)  # after the load, which makes the recipes anew with the saved warps
    assert len(list(fresh)) == 5 and told == ['cpu'], "the rest of the epoch, through the graph the checkpoint came from"
    monkeypatch.setattr(loader, 'dali_device_id', lambda device: 0)  # as on a GPU, where the graphs differ
    told_gpu = index_loader(files[:12], 2, train=True, seed=0, decode_on='gpu')
    before = (told_gpu._source, told_gpu._epoch_no)
    with pytest.raises(ValueError, match=r"decoded its JPEGs on the CPU \(decode_on='cpu'\).*make this loader with decode_on='cpu' or 'auto'"):
        told_gpu.load_state_dict(state)
    assert (told_gpu._source, told_gpu._epoch_no) == before, "the refused state changed nothing"


def test_a_ranks_validation_loader_keeps_the_cpus_decoders(files, monkeypatch):
    "Under DDP only the training loaders choose (the ranks read them in step, and agree through `ranks_max`)"
    _switch_costs(monkeypatch, 1e-9)
    valid,train = index_loader(files[:8], 2, seed=0).shard(0, 2),index_loader(files[:8], 2, train=True, seed=0).shard(0, 2)
    for _ in range(3): epoch_items(valid); epoch_items(train)
    assert (valid.decoding, train.decoding) == ('cpu', 'gpu')


def test_a_ranks_training_loader_moves_when_any_rank_would(files, monkeypatch):
    "Under DDP a training loader asks `ranks_max` at every epoch's start whether any rank would move, and moves on its answer, not its own"
    import dali_fastai.loader as loader
    asked = []
    monkeypatch.setattr(loader, 'ranks_max', lambda v, device: asked.append(v) or float(len(asked) == 2))  # another rank would, at the 2nd
    _switch_costs(monkeypatch, 5.)
    train = index_loader(files[:8], 2, train=True, seed=0).shard(0, 2)
    for _ in range(3): epoch_items(train)
    assert asked == [0., 0.] and train.decoding == 'gpu', "asked at each start until it moved, with its own verdict: no (epochs too short for a trial)"


_MOVE_TOGETHER = """
import sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[3])
from helpers import index_loader
import dali_fastai.loader as loader
rank = int(sys.argv[1])
loader.gpu_decoder_cost = lambda device_id, ranks_here: 1e-9 if rank == 0 else 1e9  # only rank 0 finds the start paid
dist.init_process_group('gloo', init_method='file://' + sys.argv[2], rank=rank, world_size=2)
from pathlib import Path
dl = index_loader(sorted(Path(sys.argv[4]).glob('*.png'))[:16], 2, train=True, seed=0).shard(rank, 2)
where = []
for _ in range(3): where.append(dl.decoding); list(dl)
print(where + [dl.decoding], dl._source.builds, loader.ranks_max([float(rank), 1. - rank], 'cpu'))  # each value's largest
dist.destroy_process_group()
"""

def test_the_ranks_move_at_the_same_epoch(files, tmp_path):
    "Two processes (gloo) through `ranks_max`, only one of which would move: both move at the same epoch (a rank left asking alone would hang DDP)"
    script = tmp_path/'move_together.py'
    script.write_text(_MOVE_TOGETHER)
    tests = str(Path(__file__).parent)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path/'store'), tests, str(files[0].parent)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try: outs = [p.communicate(timeout=240)[0].strip().splitlines()[-1] for p in procs]
    finally:
        for p in procs: p.kill()
    assert outs == ["['cpu', 'cpu', 'gpu', 'gpu'] 2 [1.0, 1.0]"]*2, outs


def _jpegs(folder, n:int)->ImageItems:
    "`n` smooth 48 x 64 JPEGs, labelled by their index"
    yy,xx = np.mgrid[:48, :64]
    files = []
    for i in range(n):
        img = np.stack([(xx*4 + i*9) % 256, (yy*5 + i*17) % 256, (xx + yy + i*31) % 256], -1).astype(np.uint8)
        files.append(folder/f'{i:03d}.jpg'); Image.fromarray(img).save(files[-1], quality=95)
    return ImageItems(files, list(range(n)), [str(i) for i in range(n)])


@needs_gpu('decoding on the CPU for the GPU')
def test_decode_on_cpu_gives_the_gpus_batches_without_a_gpu_decoder(tmp_path):
    "On the GPU: the same items, images within JPEG decoders' rounding of the GPU-decoded ones, on the GPU, no decoder kept"
    items = _jpegs(tmp_path, 12)
    release_decoders()
    cpu = DaliDataLoader(items, bs=4, size=32, device='cuda', seed=0, decode_on='cpu')
    batches = [(x, y) for x,y in cpu]
    assert _KEPT == {}, "no GPU decoder kept for a loader that decodes on the CPU"
    assert all(x.is_cuda and y.is_cuda for x,y in batches) and len(batches) == 3
    gpu = DaliDataLoader(items, bs=4, size=32, device='cuda', seed=0, decode_on='gpu')
    for (xc,yc),(xg,yg) in zip(batches, gpu):
        assert torch.equal(yc, yg)
        assert (xc - xg).abs().mean() < 0.05, "libjpeg-turbo's and nvJPEG's pixels differ by rounding only"
    assert 'NVIMGCODEC_EXTENSIONS_PATH' not in os.environ


@needs_gpu("decode_on='auto' moving to the GPU's decoders")
def test_auto_starts_no_gpu_decoder_until_it_moves(tmp_path, monkeypatch):
    "On the GPU: the default decodes on the CPU's threads with no GPU decoder started; once the waits pay, the GPU's, kept for the process"
    items = _jpegs(tmp_path, 12)
    release_decoders()
    dl = DaliDataLoader(items, bs=4, size=32, device='cuda', seed=0, train=True)
    _switch_costs(monkeypatch, 1e9)  # not worth it yet
    for _ in range(2): assert sorted(y for _,yb in dl for y in yb.tolist()) == list(range(12))
    assert _KEPT == {} and dl.decoding == 'cpu' and dl._source.waited > 0
    _switch_costs(monkeypatch, 1e-9)
    batches = [(x, y) for x,y in dl]
    assert dl.decoding == 'gpu' and list(_KEPT) == [0], "the GPU's decoder started, and kept for the process"
    assert all(x.is_cuda for x,_ in batches) and sorted(y for _,yb in batches for y in yb.tolist()) == list(range(12))
    release_decoders()


@needs_gpu("the host's waits behind a step still running on the GPU")
def test_auto_counts_no_wait_while_the_gpu_still_runs_the_step(tmp_path, monkeypatch):
    """On the GPU: a step that keeps the GPU busy past the next batch's arrival (a kernel of about a second after each batch)
    makes no wait of the loader's; with the GPU idle, the same loader's waits count"""
    items = _jpegs(tmp_path, 12)
    _switch_costs(monkeypatch, 1e9)  # counting, never moving
    def waited(step):
        dl = DaliDataLoader(items, bs=4, size=32, device='cuda', seed=0, train=True)
        for _ in range(2):
            for x,_ in dl: step(x)
        torch.cuda.synchronize()
        return dl._source.waited
    assert waited(lambda x: torch.cuda._sleep(2**30)) == 0, "each wait ended with the step still running: the step's"
    assert waited(lambda x: None) > 0, "the GPU idle: the loader's"


def test_an_abandoned_epoch_on_the_cpus_decoders_is_built_anew_past_a_few_batches(files, monkeypatch):
    "Where DALI's CPU threads decode, a build costs hundredths of a second: a GPU loader drains at most 4 batches, not 100"
    import dali_fastai.loader as loader
    from dali_fastai.epoch import default_drain_limit
    assert (default_drain_limit(torch.device('cuda', 0), 'gpu'), default_drain_limit(torch.device('cuda', 0), 'cpu')) == (100, 4)
    asked = []
    monkeypatch.setattr(loader, 'default_drain_limit', lambda device, decoding: asked.append(decoding) or 4)
    for where in ('auto', 'gpu'): index_loader(files[:8], 2, seed=0, decode_on=where).reset()
    assert asked == ['cpu', 'gpu'], "the loader says where it decodes now"


def test_only_a_whole_pass_gives_the_pace(files, monkeypatch):
    "An abandoned pass (`lr_find`'s, which reads every loss) says nothing of a fit's pace; a whole one does, from its second half"
    _paced(monkeypatch, 2)
    _switch_costs(monkeypatch, 1e9)
    dl = index_loader(files[:24], 2, train=True, seed=0)  # 12 batches: 11 gaps, 6 in the second half
    batches = iter(dl)
    for _ in range(10): next(batches)
    del batches
    assert dl._source.pace is None and dl._source.waited > 0, "its waits count, its pace does not"
    epoch_items(dl)
    assert dl._source.pace is not None
    _paced(monkeypatch, 7)
    dl._source.pace = None
    epoch_items(dl)
    assert dl._source.pace is None, "a second half shorter than PACE_BATCHES gives none"


def test_the_ranks_act_on_the_largest_trial_vote(files, monkeypatch):
    "Under DDP the trial's verdict is agreed too (`ranks_max`): a rank whose own trial was fast goes back with one that found it slower"
    import dali_fastai.loader as loader
    _paced(monkeypatch)
    _switch_costs(monkeypatch, 1e-9)
    asked = []
    monkeypatch.setattr(loader, 'ranks_max', lambda v, device: asked.append(v) or (2. if len(asked) == 3 else v))
    train = index_loader(files[:24], 2, train=True, seed=0).shard(0, 2)  # 6 batches a rank
    epoch_items(train)  # no waits counted before it: stays
    epoch_items(train)  # moves, on trial
    train._source.pace = train._source.paces['cpu']*0.5  # this rank's trial was faster
    epoch_items(train)
    assert asked == [0., 1., 0.] and (train.decoding, train._source.trial) == ('cpu', 'cpu'), "another rank's 'slower' wins"


def test_a_batch_shown_on_one_rank_asks_the_others_nothing(files, monkeypatch):
    "`one_batch` (`show_batch`) on a rank's training shard reads through an unsharded copy: no collective that one rank alone would wait in"
    import dali_fastai.loader as loader
    _switch_costs(monkeypatch, 1e-9)
    def alone(v, device): raise AssertionError("ranks_max called from one_batch")
    train = index_loader(files[:24], 2, train=True, seed=0).shard(0, 2)
    monkeypatch.setattr(loader, 'ranks_max', alone)
    x,y = train.one_batch()
    assert len(y) == 2 and train.decoding == 'cpu'


def test_a_state_saved_on_the_gpus_decoders_stays_there(files, monkeypatch):
    "A state from a loader that decoded on the GPU (decode_on='gpu', or saved before 'auto') is a choice made: no count, no trial"
    _switch_costs(monkeypatch, 1e-9)
    _paced(monkeypatch)
    saved = index_loader(files[:12], 3, train=True, seed=0, decode_on='gpu')
    _every_item_once(saved, 12, 1)
    fresh = index_loader(files[:12], 3, train=True, seed=0)
    fresh.load_state_dict(saved.state_dict())
    told = _told(fresh, monkeypatch)
    _every_item_once(fresh, 12, 4)
    assert (told, fresh._source.settled, fresh._source.time_waits) == (['gpu'], True, False)


def test_a_pass_left_then_drained_gives_no_pace(files, monkeypatch):
    "A pass abandoned after its half-way clock read, finished by `reset`'s drain in another pass, and closed later: no pace from the idle time"
    _paced(monkeypatch, 2)
    _switch_costs(monkeypatch, 1e9)
    dl = index_loader(files[:40], 2, train=True, seed=0, drain_limit=100)  # 20 batches, drained when left
    _every_item_once(dl, 40, 1)
    before = dl._source.pace
    held = iter(dl)
    for _ in range(12): next(held)
    dl.reset()  # drains the rest (at most `drain_limit` batches) or builds anew
    held.close()
    assert dl._source.pace == before


def test_state_and_copies_hold_their_own_paces(files, monkeypatch):
    dl,told,cpu = _moved(files, monkeypatch)
    state = dl.state_dict()
    dl._source.paces['gpu'] = 1.
    assert state['paces'] == {'cpu': cpu}, "the saved state does not follow the loader"


def test_a_rank_without_a_pace_follows_the_others_back_and_on(files, monkeypatch):
    "Under DDP a rank whose trial pass gave no pace goes back with the others, keeps no GPU pace of None, and decides alike next"
    import dali_fastai.loader as loader
    _paced(monkeypatch)
    _switch_costs(monkeypatch, 1e-9)
    votes = iter([0., 1., 2., 0.])  # another rank: stays, moves, finds the GPU's slower, keeps the CPU's
    monkeypatch.setattr(loader, 'ranks_max', lambda v, device: max(v, next(votes)))
    train = index_loader(files[:24], 2, train=True, seed=0).shard(0, 2)
    epoch_items(train); epoch_items(train)  # moved
    train._source.pace = None  # this rank's trial pass gave none
    epoch_items(train)
    assert (train.decoding, train._source.trial, 'gpu' in train._source.paces) == ('cpu', 'cpu', False)
    epoch_items(train)
    assert train._source.settled and train.decoding == 'cpu', "no GPU pace here: its vote leaves the choice to the ranks that have one"


class _SlowBatches:
    "DALI's iterator as `DaliEpoch` reads it: `n` batches, each taking `secs` to come"
    def __init__(self, n:int, secs:float): self.n,self.secs = n,secs
    def __next__(self):
        if not self.n: raise StopIteration
        self.n -= 1; time.sleep(self.secs)
        return [{'i': self.n}]

def test_a_wait_behind_a_step_still_running_is_not_the_loaders():
    """A wait for a batch counts (toward `decode_on='auto'`'s move) only if the work queued before it, the step, was done by
    its end: a step that keeps the GPU busy makes the host wait too, and that wait is the step's"""
    from dali_fastai.epoch import DaliEpoch, PipelineSource
    src = PipelineSource(['i']); src.time_waits = True
    list(DaliEpoch(_SlowBatches(3, 0.01), 3, source=src, queued=lambda: lambda: False))
    assert src.waited == 0, "the step was still running when each batch came"
    list(DaliEpoch(_SlowBatches(3, 0.01), 3, source=src, queued=lambda: lambda: True))
    assert src.waited >= 0.03, "the GPU had run out of work: the loader's wait"
