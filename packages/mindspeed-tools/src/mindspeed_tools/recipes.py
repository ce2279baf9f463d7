"""`mindspeed recipes [NAME]`: the shipped configs for published models.

    mindspeed recipes                          # the table: model, job, devices, memory
    mindspeed recipes qwen3-8b-pretrain > my.yaml   # one recipe, to fill in and run

A recipe is a config file of its command (`mindspeed pretrain --config my.yaml`) with the
layout for its cluster; its header says the devices, the memory per device, the predicted
peak (`mindspeed plan --config`), where the layout comes from and what to fill in
(`mindspeed_llm.recipes`). `mindspeed preflight my.yaml` rehearses it on this machine's CPU.
"""

from __future__ import annotations

from mindspeed_core.cli import ArgumentParser, Command

HELP = "list the shipped recipes (configs per published model and job), or print one"


def run(argv: list[str]) -> int:
    from mindspeed_llm.recipes import find_recipe, recipes

    p = ArgumentParser(prog="mindspeed recipes", description=HELP)
    p.add_argument("name", nargs="?", help="print this recipe (YAML) to standard output")
    args = p.parse_args(argv)
    if args.name:
        print(find_recipe(args.name).read_text(encoding="utf-8"), end="")
        return 0
    rows = [("recipe", "command", "model", "devices", "memory", "predicted peak")]
    rows += [(r.name, r.command, r.model, f"{r.devices} ({r.nodes} node{'s' * (r.nodes > 1)})",
              f"{r.memory_gb:g} GiB", f"{r.predicted_peak_gib:g} GiB") for r in recipes()]  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    print("\nmindspeed recipes NAME > my.yaml; fill in its data and tokenizer; "
          "mindspeed preflight my.yaml; then torchrun ... -m mindspeed_core.cli COMMAND --config my.yaml")
    return 0


command = Command(help=HELP, run=run)
