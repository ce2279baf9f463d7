"""`mindspeed-lm-eval`: lm-eval's own command line with the "mindspeed" model registered.

    mindspeed-lm-eval --model mindspeed --model_args model=DIR,batch_size=16 \
        --tasks my_task --include_path yaml_dir/

lm-eval 0.4 finds models only in its own registry (there is no plugin entry point), so
the plain `lm_eval` script cannot see ours; this one imports `mindspeed_eval.lm` first and
then hands every argument to lm-eval unchanged.
"""

import sys


def main() -> None:
    try:
        from lm_eval.__main__ import cli_evaluate

        import mindspeed_eval.lm  # noqa: F401  (registers "mindspeed")
    except ImportError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    cli_evaluate()


if __name__ == "__main__":
    main()
