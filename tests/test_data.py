"""data/shakespeare.py: markdown -> script text, and the train/val shards it writes.

(Tokenizer, shard format, loader and FineWeb-Edu have their own test files.)"""

import numpy as np

from data import shakespeare
from data.shards import read_shard
from data.tokenizer import EOT, get_encoding

# {BR} is markdown's hard line break (two trailing spaces), {SP} one trailing space: spelled out
# because editors strip trailing whitespace.
MD = """# Hamlet

## ACT I

### SCENE I. Elsinore. A platform before the castle.

_FRANCISCO at his post. Enter to him BERNARDO_

**BERNARDO**{BR}
Who's there?



**FRANCISCO**{BR}
Nay, answer me: stand,{BR}
and unfold yourself. _\\[Aside]_{BR}
'O, the twelfth day,'\\--

*Enter King Edward, Derby, and{SP}
Artois.*
""".replace("{BR}", "  ").replace("{SP}", " ")

EXPECTED = """Hamlet

ACT I

SCENE I. Elsinore. A platform before the castle.

FRANCISCO at his post. Enter to him BERNARDO

BERNARDO:
Who's there?

FRANCISCO:
Nay, answer me: stand,
and unfold yourself. [Aside]
'O, the twelfth day,'--

Enter King Edward, Derby, and
Artois.
"""


def test_markdown_to_text():
    assert shakespeare.markdown_to_text(MD) == EXPECTED


def test_all_plays_clean_and_deterministic():
    plays = shakespeare.load_plays()
    assert len(plays) == 38 and len({n for n, _ in plays}) == 38
    assert set(shakespeare.VAL_PLAYS) <= {n for n, _ in plays}
    for name, text in plays:
        assert not any(c in text for c in "*_#\\"), name  # no markdown left
        assert "\n\n\n" not in text and text.endswith("\n") and not text.endswith("\n\n"), name
        assert text.count(":\n") > 50, name  # speaker lines
    assert shakespeare.load_plays() == plays


def test_writes_train_and_val_shards(tmp_path, capsys):
    shakespeare.main(["--out", str(tmp_path)])
    printed = capsys.readouterr().out
    plays = shakespeare.load_plays()
    enc = get_encoding()
    for split, n_plays in (("train", 34), ("val", 4)):
        tokens = np.asarray(read_shard(tmp_path / f"{split}.bin"))
        assert int((tokens == EOT).sum()) == n_plays  # EOT before each play, none inside (plain text)
        assert (
            tokens[0] == EOT
            and f"{split}: {n_plays} plays" in printed
            and f"{len(tokens):,} tokens" in printed
        )
    val = [t for n, t in plays if n in shakespeare.VAL_PLAYS]
    expected = [tok for text in val for tok in [EOT] + enc.encode_ordinary(text)]
    assert read_shard(tmp_path / "val.bin").tolist() == expected
