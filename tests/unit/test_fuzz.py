"""The parsers under 100,000 mutated inputs (tests/fuzz/fuzz_parsers.py): only their own errors."""

from tests.fuzz import fuzz_parsers


def test_100k_mutated_inputs_raise_only_the_parsers_own_errors(capsys):
    result = fuzz_parsers.run(inputs=100_000, seed=20261123)
    with capsys.disabled():
        print(
            f"\nfuzzed {result['inputs']} inputs in {result['seconds']} s, {len(result['crashes'])} crashes"
        )
    assert result["inputs"] == 100_000
    assert not result["crashes"], result["crashes"][:5]
    for name, count in result["targets"].items():
        assert count["parsed"] and count["rejected"], f"{name}: mutations never reach both outcomes"
