"""The gated delta rule of target/linear_attention.py: its chunked form is the one-token
recurrence, and a position with β = 0 and no decay leaves the state exactly as it was (what
right-padded prompts and partly kept verify steps rely on)."""

import torch
import torch.nn.functional as F

from dflash_train.target.linear_attention import delta_rule


def random_inputs(batch: int, heads: int, length: int, key_dim: int, value_dim: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    query = F.normalize(draw(batch, heads, length, key_dim), dim=-1) * key_dim**-0.5
    key = F.normalize(draw(batch, heads, length, key_dim), dim=-1)
    value = draw(batch, heads, length, value_dim)
    decay = -torch.rand(batch, heads, length, generator=generator, dtype=torch.float64) * 0.5
    beta = torch.rand(batch, heads, length, generator=generator, dtype=torch.float64)
    state = draw(batch, heads, key_dim, value_dim) * 0.1
    return query, key, value, decay, beta, state


def one_token_at_a_time(query, key, value, decay, beta, state):
    outputs = []
    for t in range(key.shape[2]):
        out, state = delta_rule(query[:, :, t:t + 1], key[:, :, t:t + 1], value[:, :, t:t + 1],
                                decay[:, :, t:t + 1], beta[:, :, t:t + 1], state)
        outputs.append(out)
    return torch.cat(outputs, dim=2), state


def test_the_chunked_rule_is_the_recurrence_across_chunks_and_padding():
    inputs = random_inputs(2, 3, 150, 8, 5)  # three 64-token chunks, the last one padded
    expected_out, expected_state = one_token_at_a_time(*inputs)
    for chunk in (64, 16, 150):
        out, state = delta_rule(*inputs, chunk=chunk)
        torch.testing.assert_close(out, expected_out, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(state, expected_state, rtol=1e-9, atol=1e-9)
    no_outputs, state = delta_rule(None, *inputs[1:])
    assert no_outputs is None
    torch.testing.assert_close(state, expected_state, rtol=1e-9, atol=1e-9)


def test_positions_without_beta_or_decay_leave_the_state_after_the_real_tokens():
    query, key, value, decay, beta, state = random_inputs(3, 2, 20, 8, 4, seed=1)
    kept = torch.tensor([20, 7, 1])  # tokens per row that count; the rest is padding or rejected drafts
    real = torch.arange(20) < kept[:, None, None]
    _, masked = delta_rule(None, key, value, decay * real, beta * real, state)
    for row, count in enumerate(kept.tolist()):
        _, alone = delta_rule(None, key[row:row + 1, :, :count], value[row:row + 1, :, :count],
                              decay[row:row + 1, :, :count], beta[row:row + 1, :, :count], state[row:row + 1])
        torch.testing.assert_close(masked[row:row + 1], alone, rtol=1e-9, atol=1e-9)
