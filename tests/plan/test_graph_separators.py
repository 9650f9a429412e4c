"""Separator detection and chain-of-blocks partitioning."""

from remat.plan.graph import Graph
from graphgen import synthetic_training_graph
from remat.plan.separators import find_separators, partition_blocks


def names(g, idx):
    return [g[i].name for i in idx]


def forward_part(g):
    return list(range(g.index("loss") + 1))


def test_residual_chain_separators_are_block_outputs():
    g = synthetic_training_graph("residual", 4, seed=0)
    seps = names(g, find_separators(g, forward_part(g)))
    assert seps == ["stem", "b0.add", "b1.add", "b2.add", "b3.add", "loss"]
    blocks = partition_blocks(g, forward_part(g))
    assert [names(g, b) for b in blocks[1:3]] == [
        ["b0.conv", "b0.relu", "b0.add"],
        ["b1.conv", "b1.relu", "b1.add"],
    ]
    # blocks partition the forward compute nodes
    flat = sorted(i for b in blocks for i in b)
    assert flat == [i for i in forward_part(g) if not g[i].is_input]


def test_unet_has_no_separator_inside_a_skip_span():
    g = synthetic_training_graph("unet", 4, seed=0)
    fwd = forward_part(g)
    seps = find_separators(g, fwd)
    skip_from = g.index("enc0.conv2")
    skip_to = g.index("dec0.skip")
    assert skip_from in seps and skip_to in seps
    assert not [s for s in seps if skip_from < s < skip_to]
    blocks = partition_blocks(g, fwd)
    inner = [b for b in blocks if g.index("enc2.conv1") in b][0]
    assert g.index("dec1.skip") in inner and g.index("enc0.down") in inner


def test_split_merge_branches_are_not_separators():
    g = Graph()
    x = g.add_input("x", 1)
    w = g.add_input("w", 1, is_output=True)  # a parameter read everywhere
    s = g.add_node("split", 1.0, 1, [x, w])
    a1 = g.add_node("a1", 1.0, 1, [s, w])
    a2 = g.add_node("a2", 1.0, 1, [a1, w])
    b1 = g.add_node("b1", 1.0, 1, [s, w])
    m = g.add_node("merge", 1.0, 1, [a2, b1])
    t = g.add_node("tail", 1.0, 1, [m, w], is_output=True)
    assert find_separators(g) == [s, m, t]
    assert partition_blocks(g) == [[s], [a1, a2, b1, m], [t]]


def test_parameter_only_nodes_are_tolerated_with_data_inputs():
    g = Graph()
    x = g.add_input("x", 1)
    w = g.add_input("w", 1, is_output=True)
    wt = g.add_node("w_t", 1.0, 1, [w])  # depends on the parameter only
    h1 = g.add_node("h1", 1.0, 1, [x])
    h2 = g.add_node("h2", 1.0, 1, [h1])
    h3 = g.add_node("h3", 1.0, 1, [h2, wt], is_output=True)
    # w_t is a second source: nothing before h3 separates
    assert find_separators(g) == [h3]
    assert find_separators(g, data_inputs=[x]) == [h1, h2, h3]
    blocks = partition_blocks(g, data_inputs=[x])
    assert blocks == [[h1], [h2], [wt, h3]]


def test_long_skip_over_whole_graph_leaves_only_ends():
    g = Graph()
    x = g.add_input("x", 1)
    a = g.add_node("a", 1.0, 1, [x])
    prev = a
    mids = []
    for i in range(5):
        prev = g.add_node(f"m{i}", 1.0, 1, [prev])
        mids.append(prev)
    end = g.add_node("end", 1.0, 1, [prev, a], is_output=True)
    assert find_separators(g) == [a, end]
