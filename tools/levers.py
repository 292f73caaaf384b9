"""Three levers on a DaliDataLoader-fed training step that `tools/step_times.py --lever` times beside the default loader.
They are measurements, not library features: each changes one thing and keeps the rest.

- `fold`: the keyword training graph with `fn.resize` folded into the warp. `decode_random_crop` decodes the crop window
  and resizes it to the output size (two resampling passes), then `augment` warps it (a third); here the crop window is
  drawn on the host side of the graph (`fn.random_crop_generator`, the draw `fn.decoders.image_random_crop` makes), decoded
  by `fn.decoders.image_slice`, and resampled once through (crop scale) x (augment's matrix). One resample less a batch,
  at the price of the resize's antialiasing when a large window shrinks to the output size.
- `threaded`: the loader's batches made by a thread of their own, one batch ahead, on a side stream of the highest
  priority, handed over by a CUDA event: the host time of `next()` (DALI's iterator and the adapter) then overlaps the
  training step instead of following it.
- `take_ahead`: the next batch taken on the training thread itself, by a callback once the backward pass is queued (the
  GPU still runs it): fastai's `Recorder` reads every training batch's loss to the CPU, so without it the host takes
  the next batch only after the GPU has finished the step, and the GPU idles meanwhile.

The numbers of 2026-11-24 (H100) are in nbs/images/step_levers_h100.txt and the bench notebook's "Third round"."""
import sys
from pathlib import Path
import torch
from nvidia.dali import fn, types
from fastai.callback.core import Callback

from dali_fastai.augment import combine_steps, lighting, warp
from dali_fastai.loader import priority_stream
from dali_fastai.pipeline import HW_DECODER_LOAD, augment_steps, decoded, decoder_args, normalize
from dali_fastai.recipe import KeywordRecipe
from dali_fastai.steps import _image_hw

sys.path.insert(0, str(Path(__file__).parent))
from handover_probe import threaded


class FoldedRecipe(KeywordRecipe):
    "The keyword training recipe, resampled once from the decoded crop window: `augment`'s matrix times the crop's scale"
    def graph(self, encoded, device_id=None, hw_decoder_load=HW_DECODER_LOAD, dtype='float32', boxes=None, decode_on='gpu')->dict:
        (h,w),aug = self.size,dict(self.aug)
        ih,iw = _image_hw(encoded)
        anchor,crop = fn.random_crop_generator(fn.cast(fn.stack(ih, iw), dtype=types.INT64), num_attempts=10,
                                               random_area=list(self.area), random_aspect_ratio=list(self.ratio))
        images = decoded(fn.decoders.image_slice(encoded, anchor, crop, axis_names='HW', **decoder_args(device_id, hw_decoder_load, decode_on)),
                         device_id)
        pad_mode,max_lighting,p_lighting = aug.pop('pad_mode', 'reflection'),aug.pop('max_lighting', 0.),aug.pop('p_lighting', 0.75)
        ch,cw = fn.cast(crop[0], dtype=types.FLOAT),fn.cast(crop[1], dtype=types.FLOAT)
        resize = fn.transforms.scale(scale=fn.stack(cw/w, ch/h))  # output pixels -> crop pixels: the first step applied
        images = warp(images, combine_steps([resize] + augment_steps(self.size, **aug)), pad_mode, size=(h, w))
        if max_lighting > 0: images = lighting(images, max_lighting, p_lighting)
        return dict(images=normalize(images, self.mean, self.std, dtype), window=None, matrix=None)


def folded(dl):
    "The training `DaliDataLoader` `dl`, its keyword recipe replaced by `FoldedRecipe` (same settings)"
    r = dl.recipes[0]
    if type(r) is not KeywordRecipe: raise ValueError(f"the fold lever needs the keyword recipe, got {type(r).__name__}")
    dl.recipes = (FoldedRecipe(True, r.size, r.crop_pct, r.area, r.ratio, r.mean, r.std, **r.aug), dl.recipes[1])
    return dl


class Wrapped:
    "A loader standing in for the `DaliDataLoader` `dl`: its length and every attribute but how it iterates"
    def __init__(self, dl): self.dl = dl
    def __len__(self): return len(self.dl)
    def __getattr__(self, k):
        if k == 'dl': raise AttributeError(k)  # not set yet (copy, pickle): no recursion into `self.dl`
        return getattr(self.dl, k)


class OnThread(Wrapped):
    "The loader's batches made by a thread one ahead, on a side stream of the highest priority, handed over by a CUDA event"
    def _made(self, side):
        "The loader's batches with the event recorded after each on `side` (runs on the worker thread)"
        with torch.cuda.stream(side):
            for b in self.dl:  # the side stream is of the highest priority: the loader's own `priority_stream` keeps it
                e = torch.cuda.Event(); e.record(side)
                yield b,e

    def __iter__(self):
        if self.dl.device.type != 'cuda': yield from threaded(iter(self.dl), depth=1); return
        side = torch.cuda.Stream(self.dl.device, priority=min(torch.cuda.Stream.priority_range()))
        with priority_stream(self.dl.device) as s:
            for b,e in threaded(self._made(side), depth=1):
                s.wait_event(e)
                for t in b: t.record_stream(s)  # made on `side`, used on `s`: the allocator must not reuse it early
                yield b


class TakeAheadLoader(Wrapped):
    "The loader's batches, of which the next can be taken before `next()` asks for it (`take_ahead`): `next()` then hands it over"
    running = ahead = None
    def __iter__(self):
        self.running,self.ahead = iter(self.dl),None  # the loader's own epoch: its stream, its errors
        try:
            while True:
                b,self.ahead = (self.ahead, None) if self.ahead is not None else (next(self.running, None), None)
                if b is None: return
                yield b
        finally: self.running = self.ahead = None

    def take_ahead(self):
        "Take the running epoch's next batch now, unless one is taken already"
        if self.running is not None and self.ahead is None: self.ahead = next(self.running, None)


class TakeAhead(Callback):
    "Take the next training batch once the backward pass is queued"
    def after_backward(self):
        if isinstance(self.dl, TakeAheadLoader): self.dl.take_ahead()


# each takes the training `DaliDataLoader` and gives a loader to train from, and the callbacks its `Learner` needs
LEVERS = {'fold': lambda dl: (folded(dl), []), 'threaded': lambda dl: (OnThread(dl), []),
          'take_ahead': lambda dl: (TakeAheadLoader(dl), [TakeAhead()])}
