"""metapatch._offload.tied_groups' size and placement bookkeeping against plain re-statements of what they
compute (pure Python: no model needed)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from metapatch._offload.tied_members import dedupe_tied_sizes

# Parameter names of a small module tree: up to three levels of modules, then a tensor name.
NAMES = st.lists(
    st.tuples(st.lists(st.sampled_from(["a", "b", "c", "0", "1"]), min_size=0, max_size=3),
              st.sampled_from(["weight", "bias", "scale"])).map(lambda t: ".".join([*t[0], t[1]])),
    min_size=2, max_size=14, unique=True)


def _prefixes(name):
    parts = name.split(".")
    return [""] + [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _table(counted):
    """A compute_module_sizes-like table: each tensor and every module above it."""
    sizes = {}
    for name, size in counted.items():
        for prefix in _prefixes(name):
            sizes[prefix] = sizes.get(prefix, 0) + size
    return sizes


@settings(max_examples=200, deadline=None)
@given(NAMES, st.data())
def test_dedupe_counts_each_group_once_at_its_anchor(names, data):
    true_sizes = {name: data.draw(st.integers(1, 1000), label=f"size {name}") for name in names}
    shuffled = data.draw(st.permutations(names), label="order")
    cut = data.draw(st.integers(2, len(names)), label="grouped")
    grouped, rest = shuffled[:cut], shuffled[cut:]
    groups, start = [], 0
    while start < len(grouped) - 1:
        end = data.draw(st.integers(start + 2, len(grouped)), label="group end")
        groups.append(tuple(grouped[start:end]))
        start = end
    for group in groups:  # members of one group share one tensor: one size
        for member in group[1:]:
            true_sizes[member] = true_sizes[group[0]]
    # How upstream counted each member: once, not at all, or at its true size.
    counted = {name: (true_sizes[name] if name in rest else
                      data.draw(st.sampled_from([0, true_sizes[name]]), label=f"counted {name}"))
               for name in names}
    sizes = _table(counted)
    dedupe_tied_sizes(sizes, groups, true_sizes.__getitem__)

    expected_counted = dict(counted)
    for group in groups:
        for member in group:
            expected_counted[member] = true_sizes[member] if member == group[0] else 0
    expected = _table(expected_counted)
    assert {k: v for k, v in sizes.items() if v} == {k: v for k, v in expected.items() if v}
