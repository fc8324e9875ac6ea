"""The timer this folder's scripts share: the median seconds of ``n`` calls after ``warmups`` untimed ones."""

import time


def median_seconds(call, *, n: int, warmups: int) -> float:
    for _ in range(warmups):
        call()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2]
