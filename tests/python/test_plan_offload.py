"""attnstash.plan(..., offload=True) and python -m attnstash.planner --offload: the device holds
the two largest stashed layers' records per micro-batch, host memory all of them, and a budget
counts the device's; without offload the plan and its table are as before."""
import pytest

import attnstash
import tiny_torch_models as plain
from attnstash.planner import plan
from attnstash.planner.__main__ import main
from plan_cases import config_of

CALLS = [2, 1, 3, 1]  # attention calls per block: layers of different sizes


def mixed_gpt():
    """A plain-PyTorch GPT whose blocks keep different bytes (more calls, more records)."""
    model = plain.gpt(layers=len(CALLS))
    for i, calls in enumerate(CALLS):
        model.blocks[i] = plain.Block(32, 4, calls=calls)
    return model


def sizes_of(p):
    """Each layer's bytes, added up here from the calls of the plan's rows."""
    return [sum(c.output_bytes + c.logsumexp_bytes + c.extra_bytes for c in layer.calls) for layer in p.layers]


def run_main(capsys, *argv):
    assert main(list(argv)) == 0
    return capsys.readouterr().out


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "config.json"
    config_of("llama").to_json_file(str(path))
    return str(path)


def test_the_device_holds_the_two_largest_layers_and_the_host_all():
    model, tokens = mixed_gpt(), plain.ids()
    p = plan(model, tokens, device="cpu", layers=plain.Block, offload=True)
    plain_plan = plan(model, tokens, device="cpu", layers=plain.Block)
    sizes = sizes_of(p)
    assert len(set(sizes)) == len(set(CALLS)) and all(sizes)
    assert p.offload and p.device_bytes == sum(sorted(sizes)[-2:])
    assert p.host_bytes == plain_plan.total_bytes == sum(sizes) > p.device_bytes
    assert p.per_layer_bytes == plain_plan.per_layer_bytes
    one = plan(plain.gpt(layers=1), tokens, device="cpu", layers=plain.Block, offload=True)
    assert one.device_bytes == one.host_bytes == sizes_of(one)[0] > 0


def test_without_offload_there_are_no_offload_figures():
    model, tokens = mixed_gpt(), plain.ids()
    p = plan(model, tokens, device="cpu", layers=plain.Block)
    assert not p.offload and p.device_bytes is None and p.host_bytes is None
    assert p == plan(model, tokens, device="cpu", layers=plain.Block, offload=False)
    with pytest.raises(ValueError, match="offload must be True or False"):
        plan(model, tokens, device="cpu", layers=plain.Block, offload="yes")


def test_a_budget_with_offload_counts_the_device_bytes():
    model, tokens = mixed_gpt(), plain.ids()
    sizes = sizes_of(plan(model, tokens, device="cpu", layers=plain.Block))
    two_largest = sum(sorted(sizes)[-2:])
    assert two_largest < sum(sizes)
    on = plan(model, tokens, device="cpu", layers=plain.Block, offload=True, max_bytes=two_largest)
    off = plan(model, tokens, device="cpu", layers=plain.Block, max_bytes=two_largest)
    assert on.layers_that_fit == len(CALLS) and off.layers_that_fit < len(CALLS)
    for budget in range(0, two_largest + 2, 8):  # against the rule stated here: the last n fit while
        # the two largest of them fit
        fit = max(n for n in range(len(sizes) + 1) if n == 0 or sum(sorted(sizes[-n:])[-2:]) <= budget)
        assert on.layers_within(budget) == fit, budget


def test_the_command_prints_the_device_and_host_figures(tiny_config, capsys):
    out = run_main(capsys, tiny_config, "--batch", "2", "--seq", "16", "--device", "cpu", "--offload")
    p = plan(tiny_config, batch_size=2, seq_len=16, device="cpu", offload=True)
    assert out == str(p) + "\n"
    sizes = sizes_of(p)
    device = next(line for line in out.splitlines() if line.startswith("offload, on the device: "))
    host = next(line for line in out.splitlines() if line.startswith("offload, in host memory: "))
    assert f": {sum(sorted(sizes)[-2:]):,} bytes" in device and "two largest" in device
    assert f": {sum(sizes):,} bytes" in host and f"all {len(sizes)} attention layers" in host
    # Everything else is the table without --offload.
    plain_out = run_main(capsys, tiny_config, "--batch", "2", "--seq", "16", "--device", "cpu")
    assert [line for line in out.splitlines() if not line.startswith("offload, ")] == plain_out.splitlines()


def test_the_command_budget_with_offload_plans_every_layer(tiny_config, capsys):
    sizes = sizes_of(plan(tiny_config, batch_size=2, seq_len=16, device="cpu"))
    n, budget = len(sizes), sum(sorted(sizes)[-2:])
    assert n > 2 and budget < sum(sizes)
    out = run_main(capsys, tiny_config, "--batch", "2", "--seq", "16", "--device", "cpu", "--max-bytes", str(budget),
                   "--offload")
    line = next(line for line in out.splitlines() if line.startswith("budget "))
    assert "on the device" in line and f"the last {n} of {n} attention layers fit" in line
    assert f"({budget:,} bytes on the device, {sum(sizes):,} in host memory)" in line
    assert f"attnstash.install_attention_stash(model, num_layers={n}, max_bytes={budget}, offload=True)" in out
    without = run_main(capsys, tiny_config, "--batch", "2", "--seq", "16", "--device", "cpu", "--max-bytes",
                       str(budget))
    fit = attnstash.plan(tiny_config, batch_size=2, seq_len=16, device="cpu", max_bytes=budget).layers_that_fit
    assert fit < n and f"the last {fit} of {n} attention layers fit ({sum(sizes[n - fit:]):,} bytes)" in without
    assert "offload" not in without and "host" not in without
