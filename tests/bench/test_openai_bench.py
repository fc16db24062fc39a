"""bench/openai_bench.py without servers: the `vllm bench serve` command it runs, and
the cached tokens it reads back from an embedded stack's ledger."""

from __future__ import annotations

from pathlib import Path

from cachepoint.bench import openai_bench as ob
from cachepoint.billing import Price, buckets
from cachepoint.gateway.billing.ledger import Attribution, Charge, record_on
from cachepoint.gateway.db.migrate import upgrade
from cachepoint.gateway.db.session import make_engine


def test_vllms_benchmark_is_pointed_at_the_endpoint_of_each_backend(tmp_path):
    args = ob.build_parser().parse_args(["--num-prompts", "8", "--prefix-len", "512"])
    for backend, endpoint in (
        ("openai-chat", "/v1/chat/completions"),
        ("openai", "/v1/completions"),
    ):
        argv = ob.bench_argv(args, "http://h:1", backend, Path("/f"), tmp_path / "r.json")
        flags = dict(zip(argv[3::2], argv[4::2], strict=False))
        assert argv[1] == "-c" and "vllm.benchmarks.serve" in argv[2]
        assert flags["--backend"] == backend and flags["--endpoint"] == endpoint
        assert flags["--dataset-name"] == "prefix_repetition"
        assert (flags["--num-prompts"], flags["--prefix-repetition-prefix-len"]) == ("8", "512")
        assert flags["--result-filename"] == "r.json"


def test_the_ledgers_cached_tokens_count_only_the_openai_rows(tmp_path):
    state = tmp_path / "stack"
    state.mkdir()
    assert ob.cached_tokens(state) is None  # no ledger: nothing to say
    engine = make_engine(f"sqlite:///{state}/cachepoint.db")
    upgrade(engine)
    price = Price(1_000_000, 1_000_000)
    rows = [("chat.completions", 100, 96), ("completions", 50, 32), ("messages", 80, 64)]
    for i, (api, prompt, read) in enumerate(rows):
        charge = Charge(
            f"req_{i}", "o", None, "k", "m", "r0", "org", buckets(prompt, read, 0, 0, 1),
            Attribution(api=api),
        )  # fmt: skip
        assert record_on(engine, charge, price)
    engine.dispose()
    assert ob.cached_tokens(state) == (96 + 32, 100 + 50)
