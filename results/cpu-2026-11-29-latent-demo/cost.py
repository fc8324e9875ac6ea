"""Per-image cost of candidate U-Nets: fp32 forward+backward+AdamW step, batch B, 2 threads."""

import json
import sys
import time

import torch

sys.path.insert(0, "/work/main")
from basic_diffusion import UNetConfig

torch.manual_seed(0)
B = int(sys.argv[2]) if len(sys.argv) > 2 else 128
CANDS = {
    "base32": dict(
        image_size=28,
        model_channels=32,
        channel_mult=(1, 2, 2),
        num_res_blocks=1,
        attention_resolutions=(7,),
        norm_groups=8,
        dropout=0.1,
    ),
    "lean16_144": dict(
        image_size=28,
        model_channels=16,
        channel_mult=(1, 4, 4),
        num_res_blocks=1,
        attention_resolutions=(7,),
        norm_groups=4,
        dropout=0.1,
    ),
    "lean16_124": dict(
        image_size=28,
        model_channels=16,
        channel_mult=(1, 2, 4),
        num_res_blocks=1,
        attention_resolutions=(7,),
        norm_groups=4,
        dropout=0.1,
    ),
    "patch2_64": dict(
        image_size=28,
        model_channels=64,
        channel_mult=(1, 2),
        num_res_blocks=1,
        attention_resolutions=(7,),
        norm_groups=16,
        patch_size=2,
        dropout=0.1,
    ),
    "patch2_32": dict(
        image_size=28,
        model_channels=32,
        channel_mult=(1, 2),
        num_res_blocks=1,
        attention_resolutions=(7,),
        norm_groups=8,
        patch_size=2,
        dropout=0.1,
    ),
    "latent8_64": dict(
        image_size=8,
        in_channels=4,
        model_channels=64,
        channel_mult=(1, 2),
        num_res_blocks=1,
        attention_resolutions=(4,),
        norm_groups=16,
        dropout=0.1,
    ),
    "latent8_32_12": dict(
        image_size=8,
        in_channels=4,
        model_channels=32,
        channel_mult=(1, 2),
        num_res_blocks=1,
        attention_resolutions=(4,),
        norm_groups=8,
        dropout=0.1,
    ),
    "latent8_48": dict(
        image_size=8,
        in_channels=4,
        model_channels=48,
        channel_mult=(1, 2, 2),
        num_res_blocks=1,
        attention_resolutions=(2,),
        norm_groups=12,
        dropout=0.1,
    ),
    "latent8_32": dict(
        image_size=8,
        in_channels=4,
        model_channels=32,
        channel_mult=(1, 2, 2),
        num_res_blocks=1,
        attention_resolutions=(2,),
        norm_groups=8,
        dropout=0.1,
    ),
}
names = sys.argv[1].split(",")
for name in names:
    cfg = UNetConfig(**CANDS[name])
    net = cfg.build()
    params = sum(p.numel() for p in net.parameters())
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x = torch.randn(B, cfg.in_channels, cfg.image_size, cfg.image_size)

    def step():
        t = torch.randint(0, 1000, (B,))
        loss = (net(x, t) - x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    ts = []
    for _ in range(8):
        t0 = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    med = ts[len(ts) // 2]
    print(
        json.dumps(dict(name=name, params=params, ms_per_step=round(med * 1e3, 1), images_per_s=round(B / med, 1))),
        flush=True,
    )
