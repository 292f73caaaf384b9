"""`decode_on='cpu'`: a GPU loader's JPEGs decoded on DALI's CPU threads and handed to the GPU, built while nvImageCodec
sees only its CPU extensions (`cpu_codecs`), with no GPU decoder kept for the process."""
import os
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
    epoch_items(index_loader(files[:8], 2, seed=0))
    assert len(kept) == 1, "decoding on the GPU (the default): the process's decoder is kept"


def test_decode_on_is_checked_by_name(files):
    with pytest.raises(ValueError, match="decode_on must be 'gpu' or 'cpu', got 'CPU'"): index_loader(files[:4], 2, decode_on='CPU')


def test_the_environment_is_left_as_it_was(files):
    "nvImageCodec's extension folder is set only while a pipeline builds"
    assert 'NVIMGCODEC_EXTENSIONS_PATH' not in os.environ
    epoch_items(index_loader(files[:4], 2, seed=0, decode_on='cpu'))
    assert 'NVIMGCODEC_EXTENSIONS_PATH' not in os.environ


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
    gpu = DaliDataLoader(items, bs=4, size=32, device='cuda', seed=0)
    for (xc,yc),(xg,yg) in zip(batches, gpu):
        assert torch.equal(yc, yg)
        assert (xc - xg).abs().mean() < 0.05, "libjpeg-turbo's and nvJPEG's pixels differ by rounding only"
    assert 'NVIMGCODEC_EXTENSIONS_PATH' not in os.environ
