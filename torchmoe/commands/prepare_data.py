"""`torchmoe prepare-data INPUT... OUT_DIR`: tokenize a corpus once into token shards
(`data.prepare`), which training reads by memory map (`training.dataset = "tokens"`).

    torchmoe prepare-data corpus/ data/tokens --tokenizer tokenizer.json --workers 8
"""

from __future__ import annotations

from collections.abc import Sequence

from torchmoe.commands.arguments import ArgumentParser, parse_args
from torchmoe.config.errors import ConfigError
from torchmoe.config.files.paths import nonempty_path
from torchmoe.config.numbers import INT64_MAX, parse_int, shown_text
from torchmoe.data import prepare as preparation
from torchmoe.data.dataset import DataConfigError
from torchmoe.data.prepare import DEFAULT_SHARD_TOKENS, HUB_PREFIX, prepare


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="torchmoe prepare-data", description="Tokenize a corpus once into shards of "
                            "token ids that training reads by memory map (training.dataset = \"tokens\"). A killed "
                            "run resumes when run again with the same arguments.")
    parser.add_argument("paths", nargs="+", metavar="INPUT... OUT_DIR",
                        help=f"local files, folders or globs (.jsonl/.json/.parquet rows, or any text files), or one {HUB_PREFIX}NAME"
                        "[:CONFIG] hub dataset; then the output folder (new, empty, or this job's own to resume)")
    parser.add_argument("--tokenizer", default="", help="tokenizer.json (or its folder); default: the built-in "
                        "byte tokenizer, as model.tokenizer_path = \"\"")
    parser.add_argument("--workers", default=str(preparation.default_workers()),
                        help="tokenizing processes (default: every core, here %(default)s)")
    parser.add_argument("--shard-tokens", default=str(DEFAULT_SHARD_TOKENS),
                        help="tokens per shard: a shard ends with the document that reaches it "
                        "(default: %(default)s)")
    parser.add_argument("--text-field", default="text", help="the JSON key / parquet column / hub field holding the "
                        "text (default: %(default)s)")
    parser.add_argument("--split", default="train", help="the hub dataset's split (default: %(default)s)")
    return parser


def _positive(flag: str, text: str, *, most: int | None = None, why: str = "") -> int:
    try:
        return parse_int(flag, text, low=1, high=INT64_MAX if most is None else most, fix=f"pass e.g. {flag} 8")
    except ConfigError:
        if most is not None and text.isascii() and text.isdecimal() and text.lstrip("0"):  # too many
            raise ConfigError(flag, shown_text(text), f"is more than {most} {why}", f"pass at most {flag} {most}") \
                from None
        raise


def _workers(text: str) -> int:
    """--workers: a positive integer, at most 4 processes per core here (tokenizing is bound by the
    cores: more only thrash, and `--workers 100000000000000000000` forked until the OS killed it)."""
    cores = preparation.default_workers()  # looked up when called: the cores of this process
    return _positive("--workers", text, most=4 * cores,
                     why=f"(4 tokenizing processes for each of the {cores} cores this process may run on)")


def prepare_main(argv: Sequence[str]) -> int:
    """`torchmoe prepare-data ...`; returns the exit status (user errors raise `ConfigError`)."""
    opts = parse_args(_parser(), argv)
    if opts is None:  # --help was printed
        return 0
    if len(opts.paths) < 2:
        raise ConfigError("torchmoe prepare-data", " ".join(argv), "needs at least one INPUT and the OUT_DIR",
                          "run e.g. `torchmoe prepare-data corpus/ data/tokens`")
    *inputs, out_dir = opts.paths
    for spec in inputs:
        nonempty_path("INPUT", spec, "name a file, folder or glob, or hf:NAME[:CONFIG]")
    nonempty_path("OUT_DIR", out_dir, "name the folder to write the shards into")
    try:
        prepare(inputs, out_dir, tokenizer_path=opts.tokenizer, workers=_workers(opts.workers),
                shard_tokens=_positive("--shard-tokens", opts.shard_tokens), text_field=opts.text_field,
                split=opts.split)
    except DataConfigError as err:
        # The sources name the settings of a training job; here the flags set them.
        flags = {"training.dataset_text_field": "--text-field"}
        if err.key in flags:
            raise DataConfigError(flags[err.key], err.value, err.problem, err.fix.replace(
                "set it to", f"set {flags[err.key]} to")) from None
        raise
    return 0
