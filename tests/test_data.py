import numpy as np
import torch
from torchvision.transforms.v2 import functional as TF

from fedmeta.data.sources import load_npz


def test_mnist_npz_is_read_as_it_is(mnist_dir):
    arrays = load_npz("mnist", mnist_dir, download=False)
    assert arrays["x"].shape == (70000, 28, 28) and arrays["x"].dtype == np.uint8
    assert (arrays["split"] == 0).sum() == 60000


def test_rmnist_has_ten_equal_rotation_groups(rmnist):
    assert len(rmnist) == 60000 and rmnist.x.shape[1:] == (1, 28, 28)
    assert torch.bincount(rmnist.groups).tolist() == [6000] * 10
    assert abs(rmnist.x.mean().item()) < 0.1  # normalized


def test_group_g_is_rotated_by_20g_degrees(rmnist):
    def mean_digit(group, label=1):
        return rmnist.x[(rmnist.groups == group) & (rmnist.y == label)].mean(0)

    upright = mean_digit(0)
    for group in (3, 9):
        rotated_back = TF.rotate(mean_digit(group), angle=-20.0 * group)
        other_angle = TF.rotate(mean_digit(group), angle=-20.0 * group + 90)
        match = torch.corrcoef(torch.stack([upright.flatten(), rotated_back.flatten()]))[0, 1]
        mismatch = torch.corrcoef(torch.stack([upright.flatten(), other_angle.flatten()]))[0, 1]
        assert match > 0.9 and mismatch < match - 0.3


def test_the_authors_rmnist_is_torchvisions_nearest_rotation_of_unscaled_pixels(mnist_dir):
    """The CAFeMe authors rotate with torchvision's default interpolation (nearest) on pixels in
    [0, 1] and do not standardize: dataset.options as their variant sets them."""
    from torchvision.transforms import functional as F_v1

    from fedmeta.data.datasets import build_rmnist

    theirs = build_rmnist(mnist_dir, seed=0, interpolation="nearest", standardize=False)
    arrays = load_npz("mnist", mnist_dir, download=False)
    images = torch.from_numpy(arrays["x"][arrays["split"] == 0]).float().div(255).unsqueeze(1)
    for group in (0, 4, 9):
        members = (theirs.groups == group).nonzero().flatten()[:50]
        expected = F_v1.rotate(images[members], 20.0 * group)  # torchvision's default interpolation
        assert torch.equal(theirs.x[members], expected)
    assert 0 <= theirs.x.min() and theirs.x.max() <= 1
    ours = build_rmnist(mnist_dir, seed=0)
    members = (ours.groups == 4).nonzero().flatten()[:50]
    assert not torch.allclose(
        ours.x[members] * 0.3081 + 0.1307, theirs.x[members], atol=1e-3
    )  # bilinear differs
