"""A chain of blocks sums a parameter's gradient over the blocks reading it as the step
differentiated whole does (the last use first), so that a budget never changes gradient bits: a
parameter tied across blocks (Marian's embedding, read by the encoder, the decoder and the head)
gets the unconstrained step's bits; a chain that could not (a weight read twice in a block before
the last reading it) is not planned."""
from __future__ import annotations

import pytest
import torch

import remat
from remat.plan.blocks import cut
from remat.plan.portfolio import _sums_gradients_like_the_step, plan_cut
from remat.plan.record import Plan
from remat.runtime.vm import run


def _compile_at_least(model, inputs, budget, loss_fn=None, **options):
    try:
        return remat.compile(model, inputs, loss_fn, budget=budget, **options)
    except remat.BudgetTooSmall as e:
        return remat.compile(model, inputs, loss_fn, budget=int(e.minimum), **options)


def _updated(program, c) -> list[torch.Tensor]:
    args = c.binding.step_args(c.signature.example, copy=True, step=1)
    run(program, *args, outputs="torch", record="peak")
    return [a for a in args if isinstance(a, torch.Tensor)]


def test_a_parameter_tied_across_blocks_gets_the_unconstrained_steps_bits():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MarianConfig(vocab_size=100, decoder_vocab_size=100, d_model=32, encoder_layers=2,
                                    decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                                    encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0,
                                    attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0,
                                    decoder_start_token_id=0)
    model = transformers.MarianMTModel(cfg)
    ids, labels = torch.randint(0, 100, (2, 16)), torch.randint(1, 100, (2, 8))
    step = _compile_at_least(model, dict(input_ids=ids, labels=labels), "50%",
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    c = step.compilation
    want = _updated(c.unconstrained, c)
    plans = [p for p in (plan_cut(c.problem, coarse) for coarse in (True, False)) if isinstance(p, Plan)]
    assert plans, "no chain of blocks planned at the budget"
    for plan in plans:  # the shared embedding (three readers) updated with the same bits
        assert all(torch.equal(a, b) for a, b in zip(_updated(plan.program, c), want))


class _ReadTwice(torch.nn.Module):
    """One linear layer read twice in each residual block (its weight shared by all blocks)."""

    def __init__(self, twice: bool):
        super().__init__()
        self.emb, self.layer, self.twice = torch.nn.Embedding(20, 8), torch.nn.Linear(8, 8), twice

    def forward(self, i):
        h = self.emb(i)
        for _ in range(3):
            inner = torch.tanh(self.layer(h)) if self.twice else h
            h = h + torch.tanh(self.layer(inner))
        return h @ self.emb.weight.t()


@pytest.mark.parametrize("twice", [False, True])
def test_a_chain_that_would_sum_a_weight_in_another_order_is_not_planned(twice):
    i, y = torch.randint(0, 20, (4, 6)), torch.randint(0, 20, (4, 6))

    def loss_fn(out, t):
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), t.flatten())

    step = _compile_at_least(_ReadTwice(twice), (i, y), "60%", loss_fn)
    p = step.compilation.problem
    blocks = cut(p.forward, p.n_state, p.n_params, backward_kept_only=False, split_bn_grad=p.split_bn_grad)
    assert blocks is not None and len(blocks.stages) > 2
    assert _sums_gradients_like_the_step(blocks, p.forward) is not twice


def test_a_chain_that_would_differentiate_an_instruction_once_per_block_is_not_planned():
    """diffusers' UNet2DModel: every residual block reads the timestep embedding, which a cut
    computes again in each block reading it. Its weights' gradients would then be summed over the
    blocks, where the step differentiates the one instruction on its summed output gradient (at the
    floor, on one thread: linear_2's weight 3.6e-12 apart): not planned; every chain planned
    updates the weights with the unconstrained step's bits."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                                  block_out_channels=(8, 16), down_block_types=("DownBlock2D", "DownBlock2D"),
                                  up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4)
    x, t, y = torch.randn(2, 3, 16, 16), torch.tensor([10, 20]), torch.randn(2, 3, 16, 16)
    step = _compile_at_least(model, (x, t, y), "50%", lambda out, tgt: torch.nn.functional.mse_loss(out.sample, tgt),
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    c = step.compilation
    p = c.problem
    want = _updated(c.unconstrained, c)
    emb = [k for k, (name, _) in enumerate(model.named_parameters()) if name == "time_embedding.linear_2.weight"][0]
    duplicated = 0
    for coarse in (True, False):
        blocks = cut(p.forward, p.n_state, p.n_params, backward_kept_only=coarse, split_bn_grad=p.split_bn_grad)
        if blocks is None:
            continue
        readers = [st for st, lead in zip(blocks.stages, blocks.binding.lead) if any(lead[j] == emb for j in st.grad_params)]
        if len(readers) > 1:
            duplicated += 1
            assert not _sums_gradients_like_the_step(blocks, p.forward)
        plan = plan_cut(p, coarse)
        if isinstance(plan, Plan):
            assert all(torch.equal(a, b) for a, b in zip(_updated(plan.program, c), want))
    assert duplicated, "no cut computes the timestep embedding in several blocks"
