import json
import sys
import time

import torch

sys.path.insert(0, "/work/main")
from ddpm.latent.autoencoder import Autoencoder, AutoencoderConfig

for ch in (8, 12, 16, 24, 32):
    for B in (64, 128):
        cfg = AutoencoderConfig(image_size=28, in_channels=1, base_channels=ch)
        m = Autoencoder(cfg)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        x = torch.rand(B, 1, 28, 28) * 2 - 1

        def step():
            xh, mean, logvar = m(x)
            loss = (xh - x).abs().mean() + 1e-3 * mean.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

        for _ in range(3):
            step()
        ts = []
        for _ in range(8):
            t0 = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t0)
        med = sorted(ts)[4]
        print(
            json.dumps(
                dict(
                    ae_channels=ch,
                    batch=B,
                    params=sum(p.numel() for p in m.parameters()),
                    ms=round(med * 1e3, 1),
                    img_s=round(B / med),
                )
            ),
            flush=True,
        )
