"""What might make DALI's CPU threads decode the training JPEGs faster, side by side on the session bench's folder:

    python tools/decode_options.py

1. A bare GPU pipeline (reader → `decoders.image_random_crop` on DALI's CPU threads → resize on the GPU → normalize), with
   and without `use_fast_idct` (libjpeg-turbo's fast integer IDCT), in turns: images per second over 60 batches of 64.
2. The session bench's training loader alone (`side_by_side`, medians of 3 passes of 40 batches) with 16, 15, 14 and 12
   CPU threads, float16 output, and 4 batches prefetched.
GPU only. Read on an H200 (16 cores), 2026-11-28: fast IDCT 8,810-9,626 img/s against 9,483-9,636 without (no gain);
loader 8,259 img/s with 16 threads (the default: every core), 8,490 with 15, 8,444 with 14, 7,717 with 12; float16 8,220;
prefetch 4 8,074 (nbs/images/decode_options_h200_20261128.txt): none is a lever beyond the passes' spread."""
import os, time, warnings


def fast_idct(files:list, rounds:int=3, n:int=60, bs:int=64)->dict:
    "Images per second of a bare pipeline with `use_fast_idct` False and True, `rounds` turns each"
    import torch
    from nvidia.dali import pipeline_def, fn, types
    @pipeline_def(batch_size=bs, num_threads=os.cpu_count(), device_id=0, seed=0, prefetch_queue_depth=2)
    def pipe(fast):
        jpegs,_ = fn.readers.file(files=files, random_shuffle=True)
        img = fn.decoders.image_random_crop(jpegs, device='cpu', output_type=types.RGB, use_fast_idct=fast,
                                            random_area=[0.08, 1.], random_aspect_ratio=[3/4, 4/3], num_attempts=10)
        img = fn.resize(img.gpu(), resize_x=224, resize_y=224)
        return fn.crop_mirror_normalize(img, dtype=types.FLOAT, output_layout='CHW', mean=[0.]*3, std=[255.]*3)
    pipes = {f: pipe(f) for f in (False, True)}
    for p in pipes.values(): p.build(); [p.run() for _ in range(10)]
    res = {False: [], True: []}
    for _ in range(rounds):
        for f,p in pipes.items():
            torch.cuda.synchronize(); a = time.perf_counter()
            for _ in range(n): p.run()
            torch.cuda.synchronize(); res[f].append(n*bs/(time.perf_counter() - a))
    return res


def main():
    warnings.filterwarnings('ignore')
    import torch
    from dali_fastai.sessionbench import _task_data
    from dali_fastai.data import DaliDataLoaders
    from dali_fastai.measure import side_by_side
    t,src,db = _task_data('classification', None, 224)
    files = sorted(str(p) for p in (src/'train').rglob('*.jpg'))
    for f,rates in fast_idct(files).items(): print(f"bare pipeline, use_fast_idct={f}: " + ', '.join(f"{r:,.0f}" for r in rates) + " img/s")
    dev = torch.device('cuda')
    dls = DaliDataLoaders.from_dblock(db, src, bs=64, device=dev, seed=0)
    variants = {f'threads {k}': dls.train.new(num_threads=k) for k in (16, 15, 14, 12)}
    variants['threads 16, float16'] = dls.train.new(num_threads=16, dtype='float16')
    variants['threads 16, prefetch 4'] = dls.train.new(num_threads=16, prefetch=4)
    for k,v in side_by_side(variants, dev, n_batches=40, warmup=10, passes=3).items(): print(f"training loader alone, {k}: {v:,.0f} img/s")


if __name__ == '__main__': main()
