"""target/gguf_header.py reads what gguf-py's own GGUFReader reads, from files gguf-py's GGUFWriter
wrote: every value type, arrays of each, nested arrays, an alignment of its own, tensors of
several types; and refuses a truncated file, another version and a file that is not GGUF."""

import gguf
import numpy as np
import pytest
from dflash_train.target.gguf_header import read_gguf_header

T = gguf.GGUFValueType
SCALARS = [
    ("u8", 200, T.UINT8), ("i8", -100, T.INT8), ("u16", 60000, T.UINT16), ("i16", -30000, T.INT16),
    ("u32", 4_000_000_000, T.UINT32), ("i32", -2_000_000_000, T.INT32), ("f32", 1e-5, T.FLOAT32),
    ("bool", True, T.BOOL), ("string", "é ▁token\n", T.STRING), ("u64", 2**63 + 5, T.UINT64),
    ("i64", -(2**62), T.INT64), ("f64", 1 / 3, T.FLOAT64),
]


def _write(path, alignment=None):
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, value, kind in SCALARS:
        writer.add_key_value(f"scalar.{key}", value, kind)
        if kind != T.STRING:
            writer.add_key_value(f"array.{key}", [value, value], T.ARRAY, sub_type=kind)
    writer.add_array("array.strings", ["a", "", "ü" * 300])
    writer.add_array("array.nested", [[1, 2], [3]])
    writer.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("f16", np.ones((5,), dtype=np.float16))
    writer.add_tensor("i8", np.arange(7, dtype=np.int8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_header_equals_gguf_pys_reader(tmp_path, alignment):
    path = _write(tmp_path / "every-type.gguf", alignment)
    header, reference = read_gguf_header(path), gguf.GGUFReader(str(path))
    assert header.version == reference.fields["GGUF.version"].contents() == 3
    expected = {key: field for key, field in reference.fields.items() if not key.startswith("GGUF.")}
    assert list(header.fields) == list(expected)
    for key, field in expected.items():
        ours = header.fields[key]
        assert ours.type == field.types[0], key
        assert ours.element_type == (field.types[1] if len(field.types) > 1 else None), key
        if key != "array.nested":  # gguf-py's contents() flattens nested arrays
            assert ours.value == field.contents(), key
    assert header.fields["array.nested"].value == [[1, 2], [3]]
    assert [(t.name, t.shape, t.ggml_type, t.offset) for t in header.tensors] == [
        (t.name, tuple(int(n) for n in t.shape), int(t.tensor_type), t.data_offset) for t in reference.tensors]
    data = path.read_bytes()
    for ours, theirs in zip(header.tensors, reference.tensors):
        assert data[ours.offset:ours.offset + theirs.n_bytes] == np.asarray(theirs.data).tobytes(), ours.name


def test_broken_files_are_value_errors_that_say_what_is_wrong(tmp_path):
    good = _write(tmp_path / "good.gguf").read_bytes()
    cases = {
        "truncated": (good[:300], "ends inside its header"),
        "version 1": (good[:4] + (1).to_bytes(4, "little") + good[8:], "GGUF version 1"),
        "big-endian": (good[:4] + (3).to_bytes(4, "big") + good[8:], r"a big-endian GGUF file \(version 3\)"),
        "not gguf": (b"PK\x03\x04" + good[4:], "GGUF magic"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(content)
        with pytest.raises(ValueError, match=message):
            read_gguf_header(path)
