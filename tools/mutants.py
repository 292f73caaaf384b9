#!/usr/bin/env python3
"""Planted mutants: known bugs, one at a time, in a copy of `dali_fastai/`; each must make a test fail.

Each row of `MUTANTS` is (module, original text, mutated text, the promise it breaks). For every mutant the package is
copied to a temporary folder, the original text (which must occur exactly once) is replaced, and the tests that matter
for that module (`SELECTIONS`, or the whole fast suite with `--all-tests`) run with the copy first on the import path,
stopping at the first failure. The real files are never touched. A mutant is killed when a test fails (or the run
times out: a hang is a failure too); it survives when every selected test passes.

After a refactoring, a row whose original text has moved stops the run at once with
"mutant N no longer applies: <file> has no <text>": update the row (or drop it, if the promise went away).

Why planted mutants and not a generic tool (mutmut): on 2 cores, a suite of ~800 tests run once per generated mutant
takes days; these rows are the promises the README makes (default augmentation, the callbacks' effect on the schedule,
exact len and exactly-once accounting), checked in minutes.

    python tools/mutants.py                # all mutants (`make mutants`)
    python tools/mutants.py --only 3,7     # some of them
    python tools/mutants.py --list         # the table
    python tools/mutants.py --all-tests    # every mutant against the whole suite but the notebooks (slow)
"""
import argparse, os, re, shutil, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = 'dali_fastai'

# (module, original text, mutated text, the promise it breaks)
MUTANTS = [
    # README's default augmentation table (`augment` and `train_pipeline` in pipeline.py, the fixed warps in loader.py)
    ('pipeline', 'p_hflip:float=0.5, # probability', 'p_hflip:float=0.4, # probability', 'hflip p=0.5'),
    ('pipeline', 'p_vflip:float=0.1, # probability', 'p_vflip:float=0.2, # probability', 'vflip p=0.1'),
    ('pipeline', 'p_rotate:float=0.075, # probability', 'p_rotate:float=0.75, # probability', 'rotate p=0.075'),
    ('pipeline', 'rotate_range:tuple=(-7., 7.), # rotation', 'rotate_range:tuple=(-10., 10.), # rotation', 'rotate U(-7°, 7°)'),
    ('pipeline', 'p_warp:float=0.025, # probability', 'p_warp:float=0.05, # probability', 'warp p=0.025 each'),
    ('loader', "aug.pop('n_warps', 7)", "aug.pop('n_warps', 5)", '7 fixed warps'),
    ('loader', "synthetic_warps(aug.pop('n_warps', 7), aug.get('warp_magnitude', 0.1)",
               "synthetic_warps(aug.pop('n_warps', 7), aug.get('warp_magnitude', 0.2)", 'warp x, y ~ U(-0.1, 0.1)'),
    ('pipeline', 'n_warps:int=7, # number of warps', 'n_warps:int=4, # number of warps', "warp_mode='random': 7 warps"),
    ('pipeline', 'warp_magnitude:float=0.1, # x, y range', 'warp_magnitude:float=0.2, # x, y range', 'random warps U(-0.1, 0.1)'),
    ('pipeline', "pad_mode:str='reflection', # fill", "pad_mode:str='zeros', # fill", 'reflection padding'),
    ('pipeline', "pad_mode:str='reflection', # fill", "pad_mode:str='border', # fill", 'reflection padding'),
    ('pipeline', 'compose:bool=True, # multiply', 'compose:bool=False, # multiply', 'one composed resample'),
    ('pipeline', 'area:tuple=(0.08, 1.), # random-resized-crop', 'area:tuple=(0.25, 1.), # random-resized-crop', 'crop area 0.08–1'),
    ('pipeline', 'ratio:tuple=(3/4, 4/3), # random-resized-crop', 'ratio:tuple=(0.9, 1.1), # random-resized-crop', 'crop ratio 3/4–4/3'),
    ('loader', 'crop_pct:float=0.875, # validation', 'crop_pct:float=1.0, # validation', 'valid crop_pct 0.875'),
    ('pipeline', 'IMAGENET_MEAN = (0.485,', 'IMAGENET_MEAN = (0.5,', 'ImageNet stats'),
    ('pipeline', 'IMAGENET_STD = (0.229,', 'IMAGENET_STD = (0.25,', 'ImageNet stats'),
    # the folded subset draw (vertical flip and fixed warps as one choice) and the composed matrix
    ('augment', '(np.arange(2**len(ps))[:, None] >> np.arange(len(ps))) & 1',
                '(np.arange(2**len(ps))[:, None] >> np.arange(len(ps))[::-1]) & 1', 'vflip/warp subset bit order'),
    ('augment', 'if k >> i & 1]', 'if k >> (len(mats) - 1 - i) & 1]', 'vflip/warp subset bit order'),
    ('augment', 'fn.transforms.combine(*reversed(steps))', 'fn.transforms.combine(*steps)', 'steps in the article\'s order'),
    ('augment', 'fn.random.coin_flip(probability=p)', 'fn.random.coin_flip(probability=min(1., 2*p))', 'every step\'s p'),
    # the callbacks' effect on the schedule, and a clean epoch after an abandoned one
    ('callbacks', 'order = ParamScheduler.order - 1', 'order = ParamScheduler.order + 1', 'ClampSchedPos before the scheduler'),
    ('callbacks', 'end = (self.epoch + 1) / self.n_epoch', 'end = 1.', 'ClampSchedPos: within the epoch\'s share'),
    ('callbacks', 'def before_train(self): restart_epoch(self.dl)', 'def before_train(self): pass', 'DaliResetCallback after lr_find'),
    ('callbacks', 'if 0 < read < size:', 'if False:', 'DaliResetCallback drains an abandoned DALI epoch'),
    # exact len and exactly-once accounting
    ('epoch',   'return n_items // bs if drop_last else -(-n_items // bs)',
               'return n_items // bs if drop_last else n_items // bs + 1', 'len = batches yielded'),
    ('epoch',   'return [(r+1)*n_items//world_size - r*n_items//world_size for r in range(world_size)]',
               'return [n_items//world_size for r in range(world_size)]', 'shards cover every item'),
    ('epoch',   'return max(counts) if pad else min(counts)', 'return min(counts) if pad else max(counts)', 'ranks step together'),
    ('epoch',   'for r,s in enumerate(sizes):', 'for r,s in reversed(list(enumerate(sizes))):', 'sharded valid set in item order'),
    ('loader', 'drop_last = train if drop_last is None else drop_last', 'drop_last = False if drop_last is None else drop_last',
               'training drops the last partial batch'),
    ('loader', 'shuffle = train if shuffle is None else shuffle', 'shuffle = False if shuffle is None else shuffle',
               'training reshuffles every epoch'),
    ('epoch',   'if self.taken >= self.n: continue', 'if self.taken > self.n: continue', 'the loader stops at len'),
    ('loader', 'pad=not (self.shuffle or self.drop_last))', 'pad=False)', 'sharded in-order epochs see every item'),
    ('pipeline', 'pad_last_batch=True,', 'pad_last_batch=False,', 'exactly once per epoch'),
    # height and width, on images that are not square
    ('detection', "d,(h,w) = pred['detections'],pred['size'].unbind(-1)", "d,(w,h) = pred['detections'],pred['size'].unbind(-1)",
                  'detections decoded x over the width'),
    ('detection', "for s in x.shape[-2:]], -1)}", "for s in x.shape[-2:][::-1]], -1)}",
                  "the detector's output size is (h, w)"),
    # a detector's batch stacked as it is only where torchvision's own steps would leave it unchanged
    ('detectors', "h % self.size_divisible == 0 == w % self.size_divisible", "True", 'a batch torchvision would pad is padded'),
    ('detectors', "counts = real.sum(1).tolist()", "counts = sorted(real.sum(1).tolist())", "each image keeps its own boxes"),
    ('detectors', "(match.to(torch.float32) * (1e8 - areas[:, None]))", "(match.to(torch.float32) * (1e8 + areas[:, None]))",
                  "FCOS: the smallest box wins an anchor"),
    ('detectors', "upper[:, -num_anchors_per_level[-1]:] = float('inf')", "upper[:, -num_anchors_per_level[0]:] = float('inf')",
                  "FCOS: each level its own range of sizes"),
    ('detectors', "b[..., :2])).clamp(min=0))", "b[..., :2])))", "GIoU: disjoint boxes share no area"),
    ('detectors', "bad = real & (boxes[..., 2:] <= boxes[..., :2]).any(-1)", "bad = real & (boxes[..., 2:] < boxes[..., :2]).any(-1)",
                  "a box with no width or height is refused, as torchvision refuses it"),
    ('detectors', "n_fg = fg.sum().clamp(min=1)", "n_fg = fg.sum().clamp(min=64)", "FCOS: losses divided by the foreground count"),
    ('detectors', "low = ((iou == iou.max(dim=2, keepdim=True).values) & real[..., None]).any(dim=1)",
                  "low = (iou == iou.max(dim=2, keepdim=True).values).any(dim=1)", "RetinaNet: padding rows never match"),
    ('detectors', "res.masked_fill_((vals >= m.low_threshold) & (vals < m.high_threshold), m.BETWEEN_THRESHOLDS)",
                  "res.masked_fill_((vals >= m.low_threshold) & (vals < m.high_threshold), m.BELOW_LOW_THRESHOLD)",
                  "RetinaNet: anchors between the thresholds are ignored"),
    ('detectors', "n_fg = fg.sum(1).clamp(min=1)", "n_fg = fg.sum().clamp(min=1)",
                  "RetinaNet: each image's losses divided by its own foreground count"),
    ('detectors', "        return torch.where(low, best, res)", "        return res", "RetinaNet: each box keeps its best anchors"),
    ('detectors', "key = (tuple(map(tuple, image_list.image_sizes)), tuple(image_list.tensors.shape[-2:]),",
                  "key = (tuple(image_list.tensors.shape[-2:]),", "anchors made again for another batch"),
    ('detectors', "res[to_device_async(rows, flat.device)] = flat", "res[:len(flat)] = flat", "each image's boxes padded in its own row"),
    ('targets', 'h,w = self.out_hw', 'w,h = self.out_hw', 'boxes and points scaled x over the width'),
    ('targets', 'pts.new_tensor([self.item_hw[1], self.item_hw[0]])', 'pts.new_tensor([self.item_hw[0], self.item_hw[1]])',
                'window to item pixels, x over the width'),
    # each split and each record read from where the arguments say
    ('data', 'TFRecordItems(s, v, image_key, label_key, label_offset, targets=t)',
             'TFRecordItems(s, v, image_key, label_offset=label_offset, targets=t)', "from_tfrecord reads label_key"),
    ('data', 'zip((train_json, valid_json), ims)', 'zip((train_json, train_json), ims)', 'from_coco validates on valid_json'),
    ('data', 'for s in (train_split, valid_split)]', 'for s in (train_split, train_split)]', 'from_voc validates on valid_split'),
    ('shardindex', "d = name.find('.', name.rfind('/') + 1)", "d = name.rfind('.')", 'WebDataset keys end at the first dot'),
    # masks: sampled (not blended) at pixel centres, and with their own images on every rank
    ('masks', "interp_type=types.INTERP_NN, pixel_origin='center')", "interp_type=types.INTERP_LINEAR, pixel_origin='center')",
              'masks resampled nearest'),
    ('masks', "interp_type=types.INTERP_NN, pixel_origin='center')", "interp_type=types.INTERP_NN, pixel_origin='corner')",
              'masks sampled at pixel centres'),
    ('loader', 'else [[f[i] for i in idx] for f in self._side_files()]', 'else [list(f) for f in self._side_files()]', 'sharded in-order masks stay with their images'),
    # item flips: a coin of probability p for each item
    ('steps', 'dihedral_mat, p=tfm.p)', 'dihedral_mat, p=tfm.p, batch=True)', 'FlipItem, DihedralItem: a coin per item'),
    ('steps', 'dihedral_mat, p=tfm.p)', 'dihedral_mat, p=min(1., 2*tfm.p))', 'FlipItem(p), DihedralItem(p)'),
    # the detection step without host syncs: padding stays padding, few shapes
    ('detection', "return px * real[..., None],labels,real", "return px,labels,real", "fastai's padding rows become zero boxes"),
    ('detection', "self.rows = -(-boxes.shape[1] // self.multiple) * self.multiple", "self.rows = boxes.shape[1]",
                  "box rows padded to a multiple of 8"),
    ('targets', "A,B,C = e*i - f*h,f*g - d*i,d*h - e*g", "A,B,C = e*i - f*h,d*i - f*g,d*h - e*g", "3x3 inverses by cofactors"),
    # a captured step's anchors outlive validation batches of other sizes; one COCO evaluation for both mAP columns
    ('detectors', "if len(kept) < self.max_kept: kept[key] = anchors", "kept.clear(); kept[key] = anchors",
                  "anchors a CUDA graph reads are never dropped"),
    ('detection', "metrics = [m := DetectionMAP(), DetectionMAP('map_50', of=m)]", "metrics = [DetectionMAP(), DetectionMAP('map_50')]",
                  "detection_learner's mAP columns share one evaluation"),
    # validation in one forward of the backbone and head, with torchvision's detections for every image
    ('detection', "if hasattr(self.model, 'padded_eval'):", "if False:", "a batched detector's validation runs its backbone once"),
    ('postprocess', "v,i = s.topk(min(k, s.shape[1]), dim=1)", "v,i = s.topk(min(2*k, s.shape[1]), dim=1)",
                  "each level gives an image at most topk_candidates"),
    ('postprocess', "boxes = boxes.float() + torch.stack([labels*(w + 1), img*(h + 1)], 1).repeat(1, 2)",
                  "boxes = boxes.float() + torch.stack([labels*(w + 1), img*0], 1).repeat(1, 2)", "NMS never suppresses a box of another image"),
    ('postprocess', "if size and size + c > most:", "if size + c > most:", "NMS groups of images, none empty"),
    ('postprocess', "s = torch.where(s > thresh, s, -1.)", "s = s", "a level's candidates are those above score_thresh, NaN not first"),
    ('postprocess', "rank = torch.arange(len(img), device=img.device) - torch.searchsorted(img, torch.arange(n, device=img.device))[img]",
                  "rank = torch.arange(len(img), device=img.device)", "each image keeps its own best detections_per_img"),
    ('detection', "    return 'faster_coco_eval'", "    return 'pycocotools'",
                  "DetectionMAP evaluates with faster_coco_eval where installed"),
    ('detectors', "if (dtype, device) not in copies: copies[dtype, device] = [c.to(dtype=dtype, device=device) for c in first]",
                  "copies[dtype, device] = [c.to(dtype=dtype, device=device) for c in self.cell_anchors]",
                  "cell anchors kept per dtype, made from the first ones"),
    ('faststep', "if self.freeze_gc: GCFreeze.start()", "pass", "Python's collector skips the objects alive at a fit's start"),
    # fastai's optimizer and metrics, kept by FastStep (issue 41: promises no test held)
    ('fastopt', "g.update(self.step_kind.group(self.hypers[g['fastai_group']], g['do_wd']))",
                "g.update(self.step_kind.group(self.hypers[0], g['do_wd']))", "each parameter group keeps its own lr, mom, wd"),
    ('fastopt', "        self.opt.state = defaultdict(dict)", "        pass", "clear_state empties the optimizer's moments"),
    ('fastopt', "elif p in self.had_grad: p.grad = torch.zeros_like(p)", "elif False: pass",
                "a parameter that had a gradient steps on a zero one, as under fastai's in-place zero_grad"),
    ('fastopt', "def _wd(h, do_wd): return h['wd'] if do_wd else 0.", "def _wd(h, do_wd): return h['wd']",
                "no weight decay on norm layers and biases (wd_bn_bias=False)"),
    ('fastopt', "if g['do_wd'] and h['wd'] != 0 and ps:", "if h['wd'] != 0 and ps:",
                "no weight decay on norm layers and biases (wd_bn_bias=False), SGD and RMSProp"),
    ('faststep', "return self.func(targs, preds, **self.kwargs) if self.invert_args else self.func(preds, targs, **self.kwargs)",
                 "return self.func(preds, targs, **self.kwargs) if self.invert_args else self.func(targs, preds, **self.kwargs)",
                 "device metrics called in fastai's argument order (invert_arg)"),
    # detectors and their targets against torchvision's and fastai's behaviour on the same input
    ('postprocess', "boxes = boxes.float() + torch.stack([labels*(w + 1), img*(h + 1)], 1).repeat(1, 2)",
                  "boxes = boxes.float() + torch.stack([labels*(w + 1), img*(w + 1)], 1).repeat(1, 2)",
                  "NMS keeps the images of a tall batch apart"),
    ('detectors', "match &= dist.min(dim=3).values > 0", "match &= dist.min(dim=3).values >= 0",
                  "FCOS: an anchor point on a box edge is outside"),
    ('detectors', "and min(self.min_size[0]/min(h, w), self.max_size/max(h, w)) == 1.)", "and True)",
                  "images larger than max_size are resized with their boxes"),
    ('detectors', "if all(tuple(s) == tuple(o) for s,o in zip(image_shapes, original_image_sizes)): return result", "return result",
                  "detections of resized images scaled back to the images' size"),
    ('detectors', "return {**state, 'cell_anchors': self.__dict__.get('_cells', {}).get(None, self.cell_anchors)}",
                  "return {**state, 'cell_anchors': self.cell_anchors}", "an exported detector carries the first (float32) cell anchors"),
    ('detection', "**{'backend': coco_backend(), **kwargs}", "**{**kwargs, 'backend': coco_backend()}",
                  "DetectionMAP: a backend the user names wins"),
    ('targets', "b = _enclosing(geo.scaled(geo.points(_corners(rows)))).clamp(-1, 1) if rows.shape[1] else rows",
                "b = _enclosing(geo.scaled(geo.points(_corners(rows)))) if rows.shape[1] else rows",
                "boxes over the image's border clipped to it, as fastai's clip_remove_empty"),
    # issue 39: a session's pipelines built once
    ('loader', "            dl._source,dl._fed = self._source,self._fed", "            pass",
               "get_preds reads through the validation loader's pipeline"),
    ('data', "        valid_dl.fed_by(dls._fed_pipelines)", "        pass",
             "validation, get_preds and predict read through one pipeline"),
    ('epoch', "        self.feed.start(files, sides)", "        self.feed.start(files[:1], [s[:1] for s in sides])",
              "a fed pipeline starts each epoch over the files it is handed"),
    ('capture', "return 'graph' if graph < eager else 'eager'", "return 'graph' if graph <= eager else 'eager'",
                 "graph='auto': a tie keeps the uncaptured step"),
    ('capture', "        if key in verdicts: self.stage,self.winner = 'done',verdicts[key]", "        pass",
                 "graph='auto': a fit takes an earlier fit's winner for the same batches and parameters"),
    ('loader', "            self._source = self._pooled()  # its split's: fastai's `tta` reads the items with the training transforms too",
               "            pass", "tta's passes through the training transforms keep a pipeline of their own, built once"),
    ('loader', "        if peek is not None and not peek._source.reading: return first(peek)  # no build but the first of its kind",
               "        pass", "show_batch and show_results read through the pool of fed pipelines, not a pipeline a call"),
    # issue 39: the session bench says where a phase's time went
    ('epoch', "        self.build_seconds += time.perf_counter() - start", "        pass",
              "each pipeline build's seconds are counted (start_costs' 'pipeline builds')"),
    ('faststep', "        return self._captured + (self.capture.capture_seconds if self.capture else 0.)",
                 "        return self.capture.capture_seconds if self.capture else 0.",
                 "FastStep.capture_seconds keeps the captures of the fits before"),
    ('items', "        if id(getattr(t, 'boxes', None)) in at: t.boxes = at[id(t.boxes)]", "        pass",
              "a subset's box labels follow the whole set's boxes"),
    ('capture', "        if not getattr(self.learn.dls.train, 'priority_stream', False):",
                "        if False:",
                "under DDP a step on the default stream is captured (and the capture invalidated)"),
    ('epoch', "        if self.resume is None and key in self.other:", "        if False:",
              "every tta on records or a DDP shard builds two pipelines"),
    ('epoch', "        self._new = weakref.ref(source) if source is not None and source.unread else None",
              "        self._new = weakref.ref(source) if source is not None else None",
              "every epoch's first batch counted as a new pipeline's"),
    ('loader', "        if self.world_size == 1 and decoding == 'gpu': keep_decoder(device_id, self.hw_decoder_load)",
               "        if decoding == 'gpu': keep_decoder(device_id, self.hw_decoder_load)", "a DDP shard keeps a third decoder a rank"),
    ('loader', "        if self.world_size == 1 and decoding == 'gpu': keep_decoder(device_id, self.hw_decoder_load)",
               "        if self.world_size == 1: keep_decoder(device_id, self.hw_decoder_load)",
               "a loader that decodes on the CPU keeps a GPU decoder (its 2.3 s start) anyway"),
    ('loader', "        with cpu_codecs() if on_cpu else nullcontext(): pipe.build()", "        pipe.build()",
               "a pipeline whose decoders are all on the CPU still loads and starts nvImageCodec's nvjpeg extension"),
    ('loader', "        self._choose_decoder()  # before", "        pass  # before", "decode_on='auto' never moves to the GPU's decoders"),
    ('loader', "        if self.world_size > 1: move = ranks_max(float(move), self.device) > 0", "        pass",
               "each DDP rank decides alone: the ranks may rebuild at other epochs and read other orders"),
    ('loader', "        if self.decode_on != 'auto' or s.settled or self._fed or s.resume is not None or",
               "        if self.decode_on != 'auto' or s.settled or self._fed or",
               "a resumed epoch may move to the GPU's decoders, restoring its checkpoint into another graph"),
    ('epoch', "                elif waits and (step_done is None or step_done()): waited += time.perf_counter() - start", "                pass",
              "the host's waits for the CPU's decoders are never counted"),
    ('loader', "        self._source.abandon(default_drain_limit(self.device, self.decoding) if",
               "        self._source.abandon(default_drain_limit(self.device) if",
               "a loader on DALI's CPU threads drains 100 batches of an abandoned epoch rather than build anew"),
    ('loader', "        if s.trial: return self._try()", "        if s.trial: return",
               "a move to the GPU's decoders is never tried: a step the GPU bounds stays on the slower decoders"),
    ('loader', "now > s.paces['cpu']*(1 + TRIAL_MARGIN)", "now > s.paces['cpu']*(1 - TRIAL_MARGIN)",
               "a trial epoch on the GPU's decoders as fast as the CPU's, or within the margin, goes back"),
    ('epoch', "            if mid is not None and whole: self.sync()", "            if mid is not None: self.sync()",
              "an abandoned pass (lr_find's, which reads every loss) sets the pace a trial compares"),
    ('loader', "        else: vote = 0 if s.paces.get('gpu', math.inf) > now*(1 + TRIAL_MARGIN) else 2", "        else: vote = 0",
               "a trial slower than a CPU pace from another step (a frozen fit) sends the loader back for good, unchecked"),
    ('faststep', "StepRace.won_by('graph') if finding or short else StepRace()", "StepRace.won_by('graph') if finding else StepRace()",
                 "a short fit races, paying more than the race can win"),
    ('faststep', "        if self._buffers: self._buffers.send()", "        pass",
                 "under DDP the ranks validate with their own BatchNorm statistics once DDP no longer sends rank 0's at each forward"),
    ('epoch', "        if self.it is not None and self.epoch is None and not self.it._ever_scheduled: self.it._schedule_runs(False)",
              "        pass", "a prepared loader's first batches are still made at the first fit's first batch"),
    ('loader', "        if self._ahead: self.prepare()  #", "        if False: self.prepare()  #",
               "a pretrained model's Normalize (vision_learner) undoes the loaders' prepare"),
    ('loader', "old.builds - old.unread,old.order_seed", "old.builds,old.order_seed",
               "a loader prepared before a Normalize draws other augmentation than one that was not"),
    ('loader', "        for b in kept: yield tuple(t.clone() for t in b)", "        for b in kept: yield b",
               "what a model does in place to a served batch changes the kept pass"),
    ('loader', "        self.batches.append(tuple(t.clone() for t in b))", "        self.batches.append(b)",
               "what a model does in place to the first pass's batches changes the kept pass"),
    ('loader', "return k[1] if k is not None and k[0] is self.items else None", "return k[1] if k is not None else None",
               "a test_dl over other files, or over the validation files unlabelled, is served the validation pass"),
    ('loader', "        self._source = self._pooled()  # the pool's pipeline for the settings as they are now", "        pass  #",
               "a loader whose bs changed and changed back is served the pass kept at the other bs"),
    ('loader', "        if fed and self._pool is not None: self.fed_by(self._pool, self._keep)", "        pass",
               "after a pretrained model's Normalize or dls.to(device), validation builds a pipeline of its own, apart from predict's, and keeps nothing"),
    ('data', "**{'keep_batches': False, **kwargs}", "**kwargs",
             "each predict replaces the kept validation pass with its own"),
    ('loader', "self._fed and self.split_idx == 1 and", "self._fed and",
               "a training loader read in order keeps its pass, and replays one augmentation every epoch"),
    ('loader', "asked = self.device.type == 'cuda' if self.keep_batches is None", "asked = True if self.keep_batches is None",
               "a validation loader on the CPU, not asked to, keeps its passes in the machine's memory"),
    ('capture', "    def __reduce__(self): return (type(self), (self.warn,), {'model': self.model})", "    pass",
                "`export` after a validation on a GPU fails: FastStep's inference graphs hold a weak reference, which pickle refuses"),
    ('loader', "        reads_ahead_done()  # a pass read ahead on a thread", "        pass  #",
               "a pass starts beside the thread reading the same pipeline ahead, and reads DALI for a pass being kept"),
    ('blocks', "        if key not in done: done[key] = types(v)", "        done[key] = types(v)",
               "dblock_items runs the type transforms for every item again, not once a distinct value"),
    ('loader', "        if self._reads_ahead: self.read_ahead()  # the pass for the new settings", "        pass  #",
               "after a pretrained model's Normalize the first fit's first validation reads its pass, not read ahead"),
    ('capture', "        if isinstance(model, DistributedDataParallel): model = model.module", "        if isinstance(model, DistributedDataParallel): return",
                "under DDP a fit's validations run the inference forward uncaptured (killed on a GPU only)"),
    ('capture', "    while len(chain) < 4 and (c := chain[-1].__cause__ or chain[-1].__context__) is not None: chain.append(c)", "    pass",
                "a failed capture says only capture_end's 'operation failed due to a previous error', not what broke it"),
    ('capture', "        if at := _works_at(cb, STEP_EVENTS):", "        if at := []:",
                "GradientAccumulation's step is captured whole: its accumulated gradients are overwritten at each replay"),
    ('fastopt', "        if not self.keep_grads: self.opt.zero_grad(set_to_none=True)", "        self.opt.zero_grad(set_to_none=True)",
                "the optimizer drops the gradients a whole-step graph writes: the next step finds none and skips every parameter"),
    ('capture', "                if p.grad is None and p.requires_grad: p.grad = torch.zeros_like(p)", "                pass",
                "with fastai's own optimizer the model's replayed backward doubles the gradients from the second step (killed on a GPU only)"),
    ('capture', "        for s,t in zip((*sx, *sy), (*xs, *ys)): s.copy_(t)", "        for s,t in zip(sx, xs): s.copy_(t)",
                "a replayed whole step trains every batch on the targets it was captured with (killed on a GPU only)"),
    ('faststep', "        if self._loss_func is None: self._loss_func = self.learn.loss_func # not", "        self._loss_func = self.learn.loss_func # not",
     "a batch cancelled after its forward leaves the lent loss function kept as fastai's"),
    ('faststep', "        self.learn.loss_func = lambda *args, **kwargs: loss", "        pass",
     "fastai computes a replayed step's loss again"),
    ('capture', "    try:\n        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=torch.cuda.Stream(device), capture_error_mode='thread_local'):\n"
                "            torch.zeros(1, device=device)\n    except RuntimeError:", "    if True:",
     "after a failed capture the generator gets a new state, the graphs captured before keep the one left in capture mode: their next replay fails (killed on a GPU only)"),
    ('epoch', "elif waits and (step_done is None or step_done()):", "elif waits:",
     "a wait behind a step still running counts as the loader's: a GPU-bound step moves decode_on='auto' to the GPU's decoders"),
    ('faststep', "        if self.bucket_view and isinstance(self.learn.opt, FastOptimizer): self._views", "        if self.bucket_view: self._views",
     "DDP built with bucket views for fastai's own optimizer, whose zero_grad refuses them"),
    ('faststep', "        if self.bucket_view and isinstance(self.learn.opt, FastOptimizer): self._views = BucketViews(self.learn)",
     "        if False: self._views = BucketViews(self.learn)", "FastStep leaves DDP's default gradients: each copied back from its bucket after the all-reduce"),
    ('distributed', "        self.acc = acc if acc is not None and getattr(acc, 'ddp_handler', False) is None else None",
     "        self.acc = acc", "the DDP arguments the user gave distrib_ctx replaced by FastStep's bucket views"),
    ('distributed', "        if self.acc is not None: self.acc.ddp_handler,self.acc = None,None", "        pass",
     "a later fit with fastai's own optimizer gets DDP with bucket views, which its zero_grad refuses"),
    ('capture', "        with _no_collection(): yield", "        yield",
     "a DALI pipeline freed by the garbage collector mid-capture syncs the device: the process stops"),
    ('capture', "        (again if again is not None and _invalidated(e) else fail or capture._fail)(why)", "        (fail or capture._fail)(why)",
     "an inference forward's capture another thread broke is given up on at once: that rank validates uncaptured to the fit's end"),
    ('capture', "    return _INVALIDATED in first or (_INVALIDATED in str(chain[0]) and any(s in first for s in _LIBRARIES_MET))",
     "    return _INVALIDATED in first", "a capture another thread broke that cuDNN met first is given up on at once"),
    ('capture', "        _leftovers_spent(device)\n", "        pass\n",
     "the error cuDNN kept from a broken capture fails the next uncaptured forward, which stops the fit"),
    ('capture', "        if pool is not None: _pool_released(pool, device)", "        pass",
     "a failed capture keeps its memory pool: 40 broken ResNet-50 forwards kept 4.8 GiB on an H200"),
]

FAST = ['tests/test_defaults.py', 'tests/test_augment_stats.py']
SELECTIONS = {  # per module: pytest arguments, relative to the repository root
    'augment': FAST,
    'pipeline': FAST + ['tests/test_loader_edges.py'],
    'callbacks': ['tests/test_callbacks.py'],
    'loader': ['tests/test_loader_edges.py', 'tests/test_defaults.py', 'tests/test_distributed.py',
               '--deselect', 'tests/test_distributed.py::test_two_processes_through_distrib_ctx',
               'tests/test_reliability.py::test_exactly_once', 'tests/test_reliability.py::test_get_preds_exactly_once',
               'tests/test_mask_sampling.py', 'tests/test_session.py', 'tests/test_decode_on.py'],
    'detection': ['tests/test_detection.py'],
    'detectors': ['tests/test_detection.py'],
    'postprocess': ['tests/test_detection.py'],
    'targets': ['tests/test_box_geometry.py'],
    'data': ['tests/test_shards.py', 'tests/test_coco_voc_loaders.py', 'tests/test_session.py', 'tests/test_loader_edges.py'],
    'shardindex': ['tests/test_shards.py'],
    'masks': ['tests/test_mask_sampling.py'],
    'steps': ['tests/test_mask_sampling.py'],
    'capture': ['tests/test_faststep.py', 'tests/test_faststep_ddp.py'],
    'items': ['tests/test_coco_voc_loaders.py'],
    'faststep': ['tests/test_faststep.py', 'tests/test_faststep_ddp.py'],
    'fastopt': ['tests/test_faststep.py'],
    'blocks': ['tests/test_dblock.py'],
}
SELECTIONS['distributed'] = ['tests/test_faststep_ddp.py']
SELECTIONS['epoch'] = SELECTIONS['loader'] + ['tests/test_shards.py']  # the batch arithmetic and `DaliEpoch` keep the loader's promises
ALL_TESTS = ['tests', '--ignore', 'tests/test_notebooks.py']


def check_applies(i:int, mutant:tuple)->Path:
    "The file mutant `i` changes, after checking its original text is there exactly once"
    module,orig,_,_ = mutant
    f = ROOT/PKG/f'{module}.py'
    if not f.exists(): raise SystemExit(f"mutant {i} no longer applies: {f.relative_to(ROOT)} does not exist")
    n = f.read_text().count(orig)
    if n == 0: raise SystemExit(f"mutant {i} no longer applies: {f.relative_to(ROOT)} has no {orig!r}")
    if n > 1: raise SystemExit(f"mutant {i} no longer applies: {f.relative_to(ROOT)} has {n} copies of {orig!r}: "
                               "make the original text longer, so it names one place")
    return f


def copy_package(dest:Path, mutant:tuple|None=None)->Path:
    "A copy of the package in `dest`, with `mutant` applied"
    shutil.copytree(ROOT/PKG, dest/PKG, ignore=shutil.ignore_patterns('__pycache__'))
    if mutant is not None:
        module,orig,new,_ = mutant
        f = dest/PKG/f'{module}.py'
        f.write_text(f.read_text().replace(orig, new))
    return dest


def run_tests(copy:Path, args:list, timeout:float, workers:int)->tuple:
    """(passed, seconds, first failure) of pytest over `args` with the copy imported instead of the real package.
    The run's working directory is the copy: `python -m pytest` and pytest-xdist's workers put it first on sys.path."""
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(copy), *[p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep)
                                                                       if p and Path(p).resolve() != ROOT]])}
    cmd = [sys.executable, '-m', 'pytest', '-x', '-q', '-rf', '-p', 'no:cacheprovider', '--rootdir', str(ROOT),
           '-c', str(ROOT/'pyproject.toml'), '-n', str(workers), '--timeout', str(int(timeout)),
           *[a if a.startswith('-') else str(ROOT/a) for a in args]]
    t = time.monotonic()
    try: r = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired: return False,time.monotonic() - t,f"timed out after {timeout:.0f} s"
    failed = [l for l in r.stdout.splitlines() if l.startswith(('FAILED', 'ERROR'))]
    if r.returncode == 0: return True,time.monotonic() - t,''
    return False,time.monotonic() - t,(failed[0] if failed else f"pytest exit {r.returncode}: {r.stdout[-500:]}{r.stderr[-500:]}")


def imported_from(copy:Path)->str:
    "Where `import dali_fastai` resolves with the copy in place (it must be the copy)"
    env = {**os.environ, 'PYTHONPATH': str(copy)}
    return subprocess.run([sys.executable, '-c', f'import {PKG}; print({PKG}.__file__)'], cwd=copy, env=env,
                          capture_output=True, text=True, check=True).stdout.strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--only', help='comma-separated mutant numbers (1-based)')
    ap.add_argument('--all-tests', action='store_true', help='run the whole suite (but the notebooks) per mutant')
    ap.add_argument('--timeout', type=float, default=600, help='seconds per mutant')
    ap.add_argument('-n', '--workers', type=int, default=int(os.environ.get('N', 2)), help='pytest-xdist workers')
    ap.add_argument('--no-baseline', action='store_true', help='skip the check that the selections pass unmutated')
    ap.add_argument('--list', action='store_true', help='print the table and stop')
    a = ap.parse_args()
    todo = [int(i) for i in a.only.split(',')] if a.only else list(range(1, len(MUTANTS) + 1))
    for i in todo: check_applies(i, MUTANTS[i - 1])  # every row first: a stale table fails before any test runs
    if a.list:
        for i in todo: print(f"{i:3} {MUTANTS[i-1][0]:9} {MUTANTS[i-1][1]!r} -> {MUTANTS[i-1][2]!r}  ({MUTANTS[i-1][3]})")
        return
    selection = lambda module: ALL_TESTS if a.all_tests else SELECTIONS[module]
    with tempfile.TemporaryDirectory(prefix='mutants-') as tmp:
        base = copy_package(Path(tmp)/'base')
        where = imported_from(base)
        if not where.startswith(str(base)): raise SystemExit(f"the copy is not what gets imported ({where}): check PYTHONPATH")
        if not a.no_baseline:
            # every selection once, in one run (pytest collects a file named twice once)
            args = [x for sel in {tuple(selection(MUTANTS[i - 1][0])) for i in todo} for x in sel]
            ok,secs,why = run_tests(base, args, a.timeout*3, a.workers)
            print(f"baseline (no mutant): {'passed' if ok else 'FAILED'} in {secs:.0f} s {why}", flush=True)
            if not ok: raise SystemExit("the selected tests fail without any mutant: fix them first")
        survivors = []
        for i in todo:
            m = MUTANTS[i - 1]
            copy = copy_package(Path(tmp)/f'm{i}', m)
            passed,secs,why = run_tests(copy, selection(m[0]), a.timeout, a.workers)
            shutil.rmtree(copy)
            what = f"{m[0]}.py {m[1]!r} -> {m[2]!r} ({m[3]})"
            by = re.sub(r'^(FAILED|ERROR) (\S*?)(?=tests/)', '', why)[:200]  # the test, by its tests/ path
            print(f"mutant {i:2} {'SURVIVED' if passed else 'killed  '} {secs:5.0f} s  {what}"
                  + ('' if passed else f"\n            by {by}"), flush=True)
            if passed: survivors.append(f"{i}: {what}")
    print(f"\nkilled {len(todo) - len(survivors)} of {len(todo)}")
    for s in survivors: print(f"  survived {s}")
    sys.exit(1 if survivors else 0)


if __name__ == '__main__': main()
