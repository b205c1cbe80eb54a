"""What the diffusion runner adds around the LLM's transformer: patchify, timestep embedding, velocity head.

Latents `(B, C, h, w)` are cut into `patch_size x patch_size` patches, one token each
(row-major over the patch grid), each flattened channel-first to `C * p * p` numbers.
`DiffusionHead.embed` maps them into the LLM's hidden size and adds a fixed 2-d sin/cos
position code and an MLP of the sinusoidal timestep embedding; `DiffusionHead.velocity`
maps the transformer's (final-normed) hidden states back to patches.
"""

from __future__ import annotations

import math

import torch


def patchify(latents: torch.Tensor, patch: int) -> torch.Tensor:
    """`(B, C, h, w)` -> `(B, (h/p) * (w/p), C * p * p)`."""
    b, c, h, w = latents.shape
    if h % patch or w % patch:
        raise ValueError(f"latent size {h}x{w} is not a multiple of the patch size {patch}")
    x = latents.reshape(b, c, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // patch) * (w // patch), c * patch * patch)


def unpatchify(tokens: torch.Tensor, channels: int, height: int, width: int, patch: int) -> torch.Tensor:
    """The inverse of `patchify`."""
    b = tokens.shape[0]
    x = tokens.reshape(b, height // patch, width // patch, channels, patch, patch)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(b, channels, height, width)


def timestep_embedding(timesteps: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """`(B,)` timesteps (0..1000) -> `(B, dim)` sin/cos features (DiT's frequency embedding)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half)
    args = timesteps.float()[:, None] * freqs[None]
    return torch.cat((torch.cos(args), torch.sin(args)), dim=-1)


def grid_positions(grid_h: int, grid_w: int, dim: int) -> torch.Tensor:
    """`(grid_h * grid_w, dim)` fixed 2-d sin/cos codes: half the channels for rows, half for columns."""
    quarter = dim // 4
    freqs = 1.0 / (10000.0 ** (torch.arange(quarter, dtype=torch.float32) / max(quarter, 1)))
    rows, cols = torch.meshgrid(torch.arange(grid_h, dtype=torch.float32),
                                torch.arange(grid_w, dtype=torch.float32), indexing="ij")
    parts = []
    for axis in (rows.reshape(-1), cols.reshape(-1)):
        args = axis[:, None] * freqs[None]
        parts += [torch.sin(args), torch.cos(args)]
    codes = torch.cat(parts, dim=1)
    return torch.nn.functional.pad(codes, (0, dim - codes.shape[1]))


class DiffusionHead(torch.nn.Module):
    """Patch in-projection + positions + timestep MLP, and the velocity out-projection.

    Linear layers start as `transformers` models do (normal, std `init_std`, zero biases).
    At PyTorch's default (uniform, ~0.07 here) a random head makes a random velocity field
    steep enough that float32 rounding grows ~100x over 20 guided steps; at 0.02 the
    latents still move by O(1) while rounding stays at its own size.
    """

    def __init__(self, patch_dim: int, hidden_size: int, grid: tuple[int, int], freq_dim: int = 64,
                 init_std: float = 0.02) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.patch_in = torch.nn.Linear(patch_dim, hidden_size)
        self.time_mlp = torch.nn.Sequential(
            torch.nn.Linear(freq_dim, hidden_size), torch.nn.SiLU(), torch.nn.Linear(hidden_size, hidden_size)
        )
        self.positions = torch.nn.Buffer(grid_positions(*grid, hidden_size), persistent=False)
        self.out = torch.nn.Linear(hidden_size, patch_dim)
        for module in self.modules():
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.normal_(module.weight, std=init_std)
                torch.nn.init.zeros_(module.bias)

    def time_embeds(self, timesteps: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`(S,)` timesteps -> `(S, hidden)`: the timestep MLP of every step of a run, in one batch."""
        return self.time_mlp(timestep_embedding(timesteps.reshape(-1), self.freq_dim).to(dtype))

    def embed(self, patches: torch.Tensor, timestep: torch.Tensor, time_embed: torch.Tensor | None = None,
              ) -> torch.Tensor:
        """`(B, N, patch_dim)` patches at one timestep -> `(B, N, hidden)` transformer inputs.
        `time_embed` is that timestep's row of `time_embeds` (computed here when not given)."""
        if time_embed is None:
            time_embed = self.time_embeds(timestep, patches.dtype)[0]
        return self.patch_in(patches) + self.positions.to(patches.dtype) + time_embed

    def velocity(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out(hidden)
