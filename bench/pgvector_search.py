"""What the semantic cache's pgvector index costs: one search by partition size, one write.

    python bench/pgvector_search.py [--searches 200]

Starts a scratch embedded PostgreSQL with pgvector (``pgserver``, in a temporary
directory under /tmp, removed at the end), fills partitions of 10, 100 and 1000 random
384-dimension vectors (the local model's size; 1000 is the per-partition cap), and
times :meth:`gateway.cache.pgvector.PgVectorIndex.search` (what a semantic lookup waits for
after its embedding) and a one-row insert (what the cache actor's write task costs).
Loopback only, bounded in count. Figures on a shared 2-core box are upper bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout


async def run(searches: int) -> None:
    import numpy as np
    import pgserver  # type: ignore[import-untyped]

    from gateway.cache.pgvector import PgVectorRow, open_pgvector_index
    from gateway.cache.semantic import guard_of, unit_vector

    home = tempfile.mkdtemp(prefix="llmg-pgvector-bench-", dir="/tmp")
    server = pgserver.get_server(home, cleanup_mode="stop")
    pool = await asyncpg.create_pool(str(server.get_uri("postgres")), min_size=1, max_size=2)
    try:
        index, reason = await open_pgvector_index(pool, 100_000)
        assert index is not None, reason
        guard = guard_of("x")
        rng = np.random.default_rng(1)

        def row(partition: str) -> PgVectorRow:
            vector = unit_vector(rng.standard_normal(384))
            return PgVectorRow(partition, uuid.uuid4().hex, "g", "s", "sub", guard, vector, b"x" * 2000,
                               time.time() + 600)

        for size in (10, 100, 1000):
            partition = f"p{size}"
            for start in range(0, size, 200):
                await index.insert([row(partition) for _ in range(min(200, size - start))])
            times = []
            for _ in range(searches):
                query = unit_vector(rng.standard_normal(384))
                began = time.perf_counter()
                await index.search(partition, query, guard, 0.95)
                times.append(time.perf_counter() - began)
            times.sort()
            print(f"search, partition of {size:>4}: p50 {times[len(times) // 2] * 1000:.2f} ms"
                  f"  p99 {times[int(len(times) * 0.99) - 1] * 1000:.2f} ms")
        times = []
        for _ in range(50):
            one = [row("writes")]
            began = time.perf_counter()
            await index.insert(one)
            times.append(time.perf_counter() - began)
        times.sort()
        print(f"insert one row (with trim):   p50 {times[25] * 1000:.2f} ms  p99 {times[-1] * 1000:.2f} ms")
    finally:
        await pool.close()
        server.cleanup()
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--searches", type=int, default=200)
    asyncio.run(run(parser.parse_args().searches))


if __name__ == "__main__":
    main()
