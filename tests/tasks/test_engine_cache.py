"""The per-process engine cache: one engine per configuration, loaded once, closed explicitly."""

from __future__ import annotations

import threading

from shardline.tasks import engine_cache
from shardline.tasks.executor import ShardExecutor


def test_one_engine_per_configuration_even_under_concurrent_first_use(tiny_model):
    engines = []
    threads = [threading.Thread(target=lambda: engines.append(engine_cache.get_engine(tiny_model, max_num_seqs=4)))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(engine) for engine in engines}) == 1
    other = engine_cache.get_engine(tiny_model, max_num_seqs=8)
    assert other is not engines[0] and engine_cache.num_cached_engines() == 2
    assert engine_cache.get_runner(tiny_model, max_num_seqs=4).llm is engines[0]
    executor = engine_cache.get_executor(tiny_model, max_num_seqs=4)  # the thread host: that same runner
    assert isinstance(executor, ShardExecutor) and executor is engine_cache.get_runner(tiny_model, max_num_seqs=4)
    assert engine_cache.close_engines() == 2
    assert engine_cache.num_cached_engines() == 0
    assert engine_cache.get_engine(tiny_model, max_num_seqs=4) is not engines[0]
