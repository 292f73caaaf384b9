"""The augmentation's randomness is what it claims: per-step probabilities, independent coins redrawn every batch,
random warps within their magnitude, uniform rotation angles; and flips/rotations do what they say on real images."""
import numpy as np
import pytest
import torch
from nvidia.dali import pipeline_def
from PIL import Image

from dali_fastai.augment import (affine_steps, coin, random_warp_node, synthetic_warps, flip_matrix, warp_matrix,
                                 rotation_matrix)
from dali_fastai.loader import DaliDataLoader, ImageItems

N = 4000    # samples per batch
SIZE = 32
SIGMAS = 4.5
IDENTITY = np.eye(2, 3, dtype=np.float32)


def run(make, bs=N, seed=0, batches=2)->list:
    "`batches` runs of a pipeline returning `make()`'s DataNodes: a list (per batch) of arrays `[bs, ...]`"
    @pipeline_def(batch_size=bs, num_threads=2, device_id=None, seed=seed)
    def pipe(): return tuple(make())
    p = pipe(); p.build()
    return [[np.array(o.as_array()) for o in p.run()] for _ in range(batches)]


def applied(m:np.ndarray)->np.ndarray:
    "Which samples of a `[n, 2, 3]` array of matrices are not the identity"
    return ~np.all(np.abs(m - IDENTITY) < 1e-6, axis=(1, 2))


def assert_binomial(k:int, n:int, p:float, what:str):
    mean,sd = n*p,np.sqrt(n*p*(1 - p))
    assert abs(k - mean) <= SIGMAS*sd + 1, f"{what}: {k} of {n}, expected {mean:.1f} ± {SIGMAS}·{sd:.1f}"


def ks_uniform(x, lo, hi)->float:
    "Kolmogorov-Smirnov distance between the sample `x` and U(lo, hi)"
    u = np.sort((np.asarray(x, dtype=np.float64) - lo)/(hi - lo))
    n = len(u)
    return float(max(np.max(np.arange(1, n + 1)/n - u), np.max(u - np.arange(n)/n)))


def assert_uniform(x, lo, hi, what):
    crit = np.sqrt(-np.log(1e-4/2)/(2*len(x)))  # alpha = 1e-4
    d = ks_uniform(x, lo, hi)
    assert d < crit, f"{what}: KS distance {d:.4f} to U({lo}, {hi}) >= {crit:.4f} (n={len(x)})"
    assert lo - 1e-5 <= np.min(x) and np.max(x) <= hi + 1e-5, f"{what}: outside [{lo}, {hi}]"
    span = hi - lo
    assert np.min(x) < lo + 0.01*span and np.max(x) > hi - 0.01*span, f"{what}: does not reach the ends of the range"


# ---------------------------------------------------------------- the article's defaults: fixed warps

WARPS = synthetic_warps(7, seed=0)
STEPS = ['vflip', *[f'warp{i}' for i in range(7)], 'rotate', 'hflip']  # affine_steps's order
PROBS = np.array([0.1, *[0.025]*7, 0.075, 0.5])


@pytest.fixture(scope='module')
def default_steps():
    "Per batch, a `[N, 10]` bool array: which of the 10 steps each sample got; and the matrices"
    batches = run(lambda: affine_steps(SIZE, warps=WARPS), seed=1234)
    assert all(len(b) == len(STEPS) for b in batches)
    return [np.stack([applied(m) for m in b], 1) for b in batches],batches


def test_default_step_order_and_matrices(default_steps):
    flags,batches = default_steps
    m,f = batches[0],flags[0]
    expected = [flip_matrix(SIZE, horizontal=False, vertical=True),
                *[warp_matrix(float(x), float(y), SIZE) for x,y in WARPS],
                None, flip_matrix(SIZE)]
    for i,(name,e) in enumerate(zip(STEPS, expected)):
        assert f[:, i].any(), f"{name} never applied"
        if e is not None: np.testing.assert_allclose(m[i][f[:, i]], np.broadcast_to(e, m[i][f[:, i]].shape), atol=1e-5,
                                                     err_msg=f"{name}: applied matrices")


@pytest.mark.parametrize('i', range(len(STEPS)), ids=STEPS)
def test_step_probability(default_steps, i):
    flags,_ = default_steps
    for b,f in enumerate(flags): assert_binomial(int(f[:, i].sum()), N, PROBS[i], f"{STEPS[i]}, batch {b}")
    assert_binomial(int(sum(f[:, i].sum() for f in flags)), N*len(flags), PROBS[i], f"{STEPS[i]}, both batches")


PAIR_BATCHES = 12  # 48,000 samples: two warps together are then expected 30 times, and 0 is outside the bound


def test_coins_independent_across_steps():
    "Every pair of steps is applied together at the product of their rates: not exclusive, not tied"
    batches = run(lambda: affine_steps(SIZE, warps=WARPS), seed=99, batches=PAIR_BATCHES)
    f = np.concatenate([np.stack([applied(m) for m in b], 1) for b in batches])
    n = len(f)
    for i in range(len(STEPS)):
        for j in range(i + 1, len(STEPS)):
            p = PROBS[i]*PROBS[j]
            assert n*p - SIGMAS*np.sqrt(n*p*(1 - p)) - 1 > 0, "the test itself: mutually exclusive coins must fail it"
            assert_binomial(int((f[:, i] & f[:, j]).sum()), n, p, f"{STEPS[i]} and {STEPS[j]} together")
    # the number of fixed warps a sample gets is Binomial(7, 0.025), not 0-or-7 (one coin shared by all warps)
    k = f[:, 1:8].sum(1)
    assert_binomial(int((k == 1).sum()), n, 7*0.025*0.975**6, "exactly one warp")
    assert (k == 7).sum() == 0


def test_coins_redrawn_every_batch(default_steps):
    flags,_ = default_steps
    a,b = flags
    for i,name in enumerate(STEPS):
        assert not np.array_equal(a[:, i], b[:, i]), f"{name}: the same samples in two consecutive batches"
    warped_a,warped_b = set(np.flatnonzero(a[:, 1:8].any(1))),set(np.flatnonzero(b[:, 1:8].any(1)))
    assert warped_a != warped_b, "the set of warped samples must change from batch to batch"
    p_any = 1 - 0.975**7
    assert_binomial(len(warped_a & warped_b), N, p_any**2, "samples warped in both batches")


def test_coins_differ_with_seed(default_steps):
    flags,_ = default_steps
    other = run(lambda: affine_steps(SIZE, warps=WARPS), seed=4321, batches=1)[0]
    assert not np.array_equal(np.stack([applied(m) for m in other], 1), flags[0])
    same = run(lambda: affine_steps(SIZE, warps=WARPS), seed=1234, batches=1)[0]
    np.testing.assert_array_equal(np.stack([applied(m) for m in same], 1), flags[0])


def test_zero_probability_steps_are_left_out():
    assert affine_steps(SIZE, p_hflip=0, p_vflip=0, p_rotate=0, warps=WARPS, p_warp=0) == []
    assert len(affine_steps(SIZE, p_hflip=1, p_vflip=0, p_rotate=0, warps=None)) == 1
    with pytest.raises(ValueError, match='between 0 and 1'): coin(1.5)


# ---------------------------------------------------------------- random warps

MAG = 0.1


def _xy(m):
    "(x, y) of `warp_matrix(x, y, SIZE)` matrices `[n, 2, 3]`"
    return -m[:, 0, 2]/SIZE,-m[:, 1, 2]/SIZE


def test_random_warps_within_magnitude_and_all_different():
    batches = run(lambda: affine_steps(SIZE, p_hflip=0, p_vflip=0, p_rotate=0, random_warps=3, warp_magnitude=MAG,
                                       p_warp=1.0), seed=7)
    assert all(len(b) == 3 for b in batches)
    xs,ys = [],[]
    for b in batches:
        for m in b:
            x,y = _xy(m)
            ref = np.stack([warp_matrix(float(a), float(c), SIZE) for a,c in zip(x[:50], y[:50])])
            np.testing.assert_allclose(m[:50], ref, atol=1e-5, err_msg="random warps are `warp_matrix(x, y)`")
            # float32 draws may collide now and then (a birthday problem), a shared draw would collide always
            assert len(np.unique(x)) > 0.99*N and len(np.unique(y)) > 0.99*N, "every sample draws its own warp"
            xs.append(x); ys.append(y)
    for a in range(len(xs)):
        for c in range(a + 1, len(xs)): assert not np.allclose(xs[a], xs[c]), "warps differ between steps and batches"
    assert_uniform(np.concatenate(xs), -MAG, MAG, 'random warp x')
    assert_uniform(np.concatenate(ys), -MAG, MAG, 'random warp y')
    assert abs(np.corrcoef(xs[0], ys[0])[0, 1]) < SIGMAS/np.sqrt(N), "x and y drawn independently"


def test_random_warp_node_with_coin():
    batches = run(lambda: (c := coin(0.025), random_warp_node(SIZE, MAG, c)), seed=11)
    for c,m in batches:
        on = c.astype(bool)
        assert_binomial(int(on.sum()), N, 0.025, 'random warp coin')
        np.testing.assert_array_equal(applied(m), on)
        x,y = _xy(m[on])
        assert np.all(np.abs(x) <= MAG + 1e-6) and np.all(np.abs(y) <= MAG + 1e-6)
    assert not np.array_equal(batches[0][0], batches[1][0]), "coins redrawn every batch"


# ---------------------------------------------------------------- rotation angles

def _angles(m):
    "Angles in degrees (counter-clockwise, as `rotation_matrix`) of rotation matrices `[n, 2, 3]`"
    return np.degrees(np.arctan2(m[:, 1, 0], m[:, 0, 0]))


@pytest.mark.parametrize('rotate_range', [(-7., 7.), (10., 30.), (-45., 5.)])
def test_rotation_angles_uniform_in_range(rotate_range):
    (m,), = run(lambda: affine_steps(SIZE, p_hflip=0, p_vflip=0, p_rotate=1., rotate_range=rotate_range),
                batches=1, seed=3)
    a = _angles(m)
    assert_uniform(a, *rotate_range, f'rotation angles {rotate_range}')
    ref = np.stack([rotation_matrix(float(d), SIZE) for d in a[:50]])
    np.testing.assert_allclose(m[:50], ref, atol=1e-4,
                               err_msg="about the centre, counter-clockwise like rotation_matrix")


def test_rotation_applied_with_p_rotate_is_uniform():
    batches = run(lambda: affine_steps(SIZE, p_hflip=0, p_vflip=0, p_rotate=0.075, rotate_range=(-7., 7.)), seed=5,
                  batches=4)
    ms = np.concatenate([b[0] for b in batches])
    on = applied(ms)
    assert_binomial(int(on.sum()), len(ms), 0.075, 'rotations')
    assert_uniform(_angles(ms[on]), -7., 7., 'angles of applied rotations')


# ---------------------------------------------------------------- on images, through a train loader

IMG = 24


@pytest.fixture(scope='module')
def asymmetric_image(tmp_path_factory):
    "A square PNG with no mirror or rotational symmetry"
    yy,xx = np.mgrid[:IMG, :IMG]
    img = np.stack([xx*10, yy*10, (xx*yy) % 256], -1).astype(np.uint8)
    img[2:6, 3:12] = (255, 0, 0)
    f = tmp_path_factory.mktemp('asym')/'a.png'
    Image.fromarray(img).save(f)
    return f


NO_AUG = dict(p_hflip=0., p_vflip=0., p_rotate=0., warp_mode=None, max_lighting=0., area=(1., 1.), ratio=(1., 1.))


def _load(f, n=1, **aug):
    dl = DaliDataLoader(ImageItems([f]*n, [0]*n, ['a']), bs=n, size=IMG, train=True, device='cpu', seed=0,
                        **{**NO_AUG, **aug})
    return dl.one_batch()[0]


def _close(a, b): return torch.allclose(a, b, atol=2/255/0.22)  # 2 grey levels, normalized


@pytest.fixture(scope='module')
def plain(asymmetric_image):
    x = _load(asymmetric_image)
    assert not _close(x, x.flip(-1)) and not _close(x, x.flip(-2)) and not _close(x, torch.rot90(x, 1, (-2, -1)))
    return x


@pytest.mark.parametrize('compose', [True, False])
def test_loader_flips_and_rotation_on_an_image(asymmetric_image, plain, compose):
    load = lambda **aug: _load(asymmetric_image, compose=compose, **aug)
    assert _close(load(p_hflip=1.), plain.flip(-1)), "p_hflip=1 mirrors left-right"
    assert _close(load(p_vflip=1.), plain.flip(-2)), "p_vflip=1 mirrors top-bottom"
    assert _close(load(p_hflip=1., p_vflip=1.), plain.flip(-1).flip(-2))
    rot = torch.rot90(plain, 1, (-2, -1))  # counter-clockwise on screen, like PIL's rotate(90)
    assert _close(load(p_rotate=1., rotate_range=(90., 90.)), rot), "rotate_range is counter-clockwise"
    # the article's order: vertical flip, warps, rotate, then horizontal flip
    assert _close(load(p_rotate=1., rotate_range=(90., 90.), p_hflip=1.), rot.flip(-1))
    assert _close(load(p_rotate=1., rotate_range=(90., 90.), p_vflip=1.), torch.rot90(plain.flip(-2), 1, (-2, -1)))


def test_loader_flip_probabilities_on_images(asymmetric_image, plain):
    "hflip 0.5 and vflip 0.1 through a train loader: the rates, their independence, and new coins for every batch"
    n,bs = 400,200
    dl = DaliDataLoader(ImageItems([asymmetric_image]*n, [0]*n, ['a']), bs=bs, size=IMG, train=True, device='cpu',
                        seed=0, **{**NO_AUG, 'p_hflip': 0.5, 'p_vflip': 0.1})
    kinds = {'none': plain, 'h': plain.flip(-1), 'v': plain.flip(-2), 'hv': plain.flip(-1).flip(-2)}
    per_batch = []
    for x,_ in dl:
        found = []
        for xi in x:
            match = [k for k,ref in kinds.items() if _close(xi[None], ref)]
            assert len(match) == 1, f"every sample is the image, flipped or not: matched {match}"
            found.append(match[0])
        per_batch.append(found)
    assert len(per_batch) == 2
    assert per_batch[0] != per_batch[1], "coins are drawn again for every batch"
    found = [k for b in per_batch for k in b]
    assert_binomial(sum('h' in k for k in found), n, 0.5, 'hflip in a loader')
    assert_binomial(sum('v' in k for k in found), n, 0.1, 'vflip in a loader')
    assert_binomial(found.count('hv'), n, 0.05, 'both flips in a loader')


@pytest.mark.parametrize('warp_mode', ['fixed', 'random'])
def test_loader_warp_modes_on_images(asymmetric_image, plain, warp_mode):
    "p_warp=1: 'fixed' gives every sample the same warp (drawn once per loader), 'random' a new one per sample"
    x = _load(asymmetric_image, n=8, warp_mode=warp_mode, n_warps=1, warp_magnitude=0.2, p_warp=1.,
              pad_mode='zeros')
    assert not any(_close(xi[None], plain) for xi in x), "every sample is warped"
    same = [torch.allclose(x[0], xi, atol=1e-5) for xi in x[1:]]
    assert all(same) if warp_mode == 'fixed' else not any(same)
