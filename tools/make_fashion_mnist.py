"""Build the small Fashion-MNIST subset that ships inside `dali_fastai` (package data).

Source: the Debian package `dataset-fashion-mnist` (Zalando SE, MIT licence), which installs the four official IDX
files under /usr/share/datasets/fashion-mnist and the licence in /usr/share/doc/dataset-fashion-mnist/copyright.

Subset recipe (deterministic, class-balanced, no random numbers involved):
- train: the first 300 images of each class, in file order, from the official train split  -> 3,000 images
- valid: the first 100 images of each class, in file order, from the official test split   -> 1,000 images
Selected images keep their file order (classes stay interleaved as in the source).

Writes, into dali_fastai/data/ (or --out):
- fashion_mnist_small.npz: uint8 `train_x` [3000,28,28], `train_y` [3000], `valid_x` [1000,28,28], `valid_y` [1000],
  `classes` (the 10 filesystem-safe names, label order), and `train_idx`/`valid_idx` (int32 rows in the source files);
  the same compressed npz format np.savez_compressed writes (np.load reads it with allow_pickle=False), but with
  fixed zip timestamps so that rerunning the script gives the same bytes (no spurious git diff);
- FASHION_MNIST_LICENSE: the MIT licence with Zalando SE's copyright line, copied from the Debian copyright file;
- README.md: source, recipe and the command that rebuilds them.

Rerun (the output is byte-for-byte stable for the same source files):
    apt-get install -y dataset-fashion-mnist
    .venv/bin/python tools/make_fashion_mnist.py
"""
import argparse, gzip, hashlib, io, re, sys, zipfile
from pathlib import Path
import numpy as np

SRC_DIR = Path('/usr/share/datasets/fashion-mnist')
COPYRIGHT = Path('/usr/share/doc/dataset-fashion-mnist/copyright')
OUT_DIR = Path(__file__).resolve().parent.parent/'dali_fastai'/'data'
# Label order of the official dataset; '/' and ' ' replaced so the names can be folder names
CLASSES = ['T-shirt_top', 'Trouser', 'Pullover', 'Dress', 'Coat', 'Sandal', 'Shirt', 'Sneaker', 'Bag', 'Ankle_boot']
N_TRAIN, N_VALID = 300, 100  # images per class

def read_idx(path:Path)->np.ndarray:
    "Read a gzipped IDX file (the MNIST format: magic 0x0000080D, big-endian dims, then uint8 data)"
    data = gzip.decompress(path.read_bytes())
    if data[:2] != b'\0\0' or data[2] != 0x08:
        raise ValueError(f"{path} is not a uint8 IDX file (magic {data[:4].hex()}): is the package complete?")
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4+4*i:8+4*i], 'big') for i in range(ndim))
    arr = np.frombuffer(data, np.uint8, offset=4+4*ndim)
    if arr.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says {shape} but holds {arr.size} values: the file is truncated")
    return arr.reshape(shape)

def first_per_class(y:np.ndarray, n:int)->np.ndarray:
    "Sorted indices of the first `n` items of each class of `y`"
    idx = np.concatenate([np.flatnonzero(y == c)[:n] for c in range(len(CLASSES))])
    counts = np.bincount(y[idx], minlength=len(CLASSES))
    if (counts != n).any(): raise ValueError(f"the source has fewer than {n} images of some class: {counts}")
    return np.sort(idx).astype(np.int32)

def load_split(prefix:str, n:int):
    "Images, labels and source rows of the class-balanced subset of split `prefix` ('train' or 't10k')"
    x = read_idx(SRC_DIR/f'{prefix}-images-idx3-ubyte.gz')
    y = read_idx(SRC_DIR/f'{prefix}-labels-idx1-ubyte.gz')
    if x.shape[1:] != (28, 28) or len(x) != len(y): raise ValueError(f"unexpected shapes {x.shape}, {y.shape}")
    idx = first_per_class(y, n)
    return x[idx], y[idx], idx

def licence_text()->str:
    "The MIT (Expat) licence of the upstream files, with their copyright line, from the Debian copyright file"
    txt = COPYRIGHT.read_text()
    # the paragraph `Files: *` names the upstream copyright holder (the `debian/*` one is the packager)
    holder = re.search(r'^Files: \*\n(?:.+\n)*?Copyright: (.+)$', txt, re.M).group(1).strip()
    holder = holder.replace('https:tech', 'https://tech')  # repair the Debian file's typo, if still there
    body = re.search(r'^License: Expat\n((?: .*\n?)+)', txt, re.M).group(1)
    body = '\n'.join('' if l.strip() == '.' else l[1:].rstrip() for l in body.rstrip('\n').split('\n'))
    if 'Zalando SE' not in holder or 'Permission is hereby granted' not in body:
        raise ValueError(f"could not find Zalando SE's MIT licence in {COPYRIGHT}: check the file by hand")
    return f"MIT License\n\nCopyright (c) {holder}\n\n{body}\n"

README = """# Package data: a small Fashion-MNIST

`fashion_mnist_small.npz` holds 4,000 of the 70,000 Fashion-MNIST images (28x28 grayscale, uint8), class-balanced:

- `train_x`, `train_y`: the first {n_train} images of each class, in file order, from the official train split ({tr:,} images);
- `valid_x`, `valid_y`: the first {n_valid} images of each class, in file order, from the official test split ({va:,} images);
- `classes`: the label names in label order, made filesystem-safe: {classes};
- `train_idx`, `valid_idx`: the rows of the selected images in the official files.

`dali_fastai.datasets.fashion_mnist()` writes them out as JPEG folders (`train/<class>/<i>.jpg`, `valid/...`).

Source: Fashion-MNIST by Zalando Research, <https://github.com/zalandoresearch/fashion-mnist>, taken from the
Debian package `dataset-fashion-mnist` ({version}). MIT licence, copyright Zalando SE: see `FASHION_MNIST_LICENSE`.

SHA-256 of the npz: `{sha}`

Rebuild with:

    apt-get install -y dataset-fashion-mnist
    python tools/make_fashion_mnist.py
"""

def deb_version()->str:
    "Version of the installed Debian package, read from dpkg's status file"
    st = Path('/var/lib/dpkg/status')
    m = st.exists() and re.search(r'^Package: dataset-fashion-mnist\n(?:.+\n)*?Version: (.+)$', st.read_text(), re.M)
    return f"version {m.group(1)}" if m else "version unknown"

def savez_stable(**arrays)->bytes:
    "What np.savez_compressed writes, but with a fixed timestamp in the zip so the bytes are reproducible"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, 'w', zipfile.ZIP_DEFLATED) as z:
        for k,a in arrays.items():
            info = zipfile.ZipInfo(f'{k}.npy', date_time=(1980,1,1,0,0,0))
            info.compress_type = zipfile.ZIP_DEFLATED
            with z.open(info, 'w', force_zip64=True) as f: np.lib.format.write_array(f, np.asanyarray(a), allow_pickle=False)
    return buf.getvalue()

def main(out:Path=OUT_DIR):
    if not SRC_DIR.exists():
        sys.exit(f"{SRC_DIR} not found: install the source with `apt-get install -y dataset-fashion-mnist`")
    train_x, train_y, train_idx = load_split('train', N_TRAIN)
    valid_x, valid_y, valid_idx = load_split('t10k', N_VALID)
    out.mkdir(parents=True, exist_ok=True)
    data = savez_stable(train_x=train_x, train_y=train_y, valid_x=valid_x, valid_y=valid_y,
                        classes=np.array(CLASSES), train_idx=train_idx, valid_idx=valid_idx)
    npz = out/'fashion_mnist_small.npz'
    npz.write_bytes(data)
    (out/'FASHION_MNIST_LICENSE').write_text(licence_text())
    (out/'README.md').write_text(README.format(
        n_train=N_TRAIN, n_valid=N_VALID, tr=len(train_y), va=len(valid_y), version=deb_version(),
        classes=', '.join(f'`{c}`' for c in CLASSES), sha=hashlib.sha256(data).hexdigest()))
    print(f"wrote {npz} ({npz.stat().st_size/1e6:.2f} MB: {len(train_y)} train, {len(valid_y)} valid), "
          f"FASHION_MNIST_LICENSE and README.md in {out}")

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--out', type=Path, default=OUT_DIR, help=f"folder to write into (default: {OUT_DIR})")
    main(p.parse_args().out)
