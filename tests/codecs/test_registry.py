"""A codec is one file and one registry line: a throwaway codec, defined here and registered for the length of
each test (its line in ``CODECS`` and its wire id, both gone after it), runs through the generic tests as they
are, as every registered codec does: round trip and wire size, bad input, the payload checksum, the link's
statistics, and its rows in the generated flag table and in the codec table."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tah.codecs import CODECS, Codec, CodecDeclaration
from megatron_tah.codecs.core import common, header
from megatron_tah.codecs.core.base import CHECKSUM_DEFAULT
from megatron_tah.codecs.core.samples import activation_like
from megatron_tah.megatron import places, stats
from tests.codecs import test_codecs, test_receive_path
from tests.codecs.core import test_checksum, test_entropy, test_graphs
from tests.helpers.codec_cases import Case, run_for
from tests.megatron import test_arguments, test_stats
from tests.studies import test_codec_report

QMAX = 127
BAD_CODE = -128  # a bad value's code

DECLARATION = CodecDeclaration()  # no options of its own, no direction parameter, no kernel


class Toy8Codec(Codec):
    """``toy8``: symmetric 8-bit integers with one fp32 scale for the whole tensor, ``max |x| / 127`` over its good
    values; a bad value (NaN, +-Inf, a magnitude above ``MAX_ABS_VALUE``) is written as the code -128 and decodes
    to NaN. Wire: header | ``scale``: fp32[1] | ``codes``: int8[numel]."""

    name = "toy8"
    codec_id = 200

    def __init__(self, backend: str = "auto", checksum: bool = CHECKSUM_DEFAULT):
        super().__init__(backend, checksum)

    def config(self) -> dict:
        return {}

    def _sections(self, shape, dtype):
        return [("scale", 4), ("codes", math.prod(shape))]

    def _encode_torch(self, x, buf, layout):
        values = x.reshape(-1).float()
        bad = common.bad_mask(values)
        values = values.masked_fill(bad, 0.0)
        scale = values.abs().amax() / QMAX
        inverse = 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = (values * inverse).round_().clamp_(-QMAX, QMAX).masked_fill_(bad, BAD_CODE)
        layout.view(buf, "scale", torch.float32).copy_(scale.reshape(1))
        layout.view(buf, "codes", torch.int8).copy_(codes.to(torch.int8))

    def _decode_torch(self, buf, shape, dtype, layout, out=None):
        codes = layout.view(buf, "codes", torch.int8)
        values = codes.float().mul_(layout.view(buf, "scale", torch.float32)).masked_fill_(codes == BAD_CODE, math.nan)
        return common.from_tiles(values.view(-1, shape[-1]), shape, dtype, out)


@pytest.fixture
def toy(monkeypatch):
    """``toy8`` registered for one test: one line in the registry, and its id as importing a codec's file records
    it (``register_codec_id``); both undone after the test."""
    monkeypatch.setitem(CODECS, Toy8Codec.name, f"{__name__}:Toy8Codec")
    monkeypatch.setitem(header._CODEC_NAMES_BY_ID, Toy8Codec.codec_id, Toy8Codec.name)
    return Case(Toy8Codec.name)


def test_round_trip_wire_size_and_determinism(toy):
    assert run_for(test_codecs.test_wire_size_matches_wire_nbytes, toy) == 15  # 3 dtypes x 5 shapes
    run_for(test_codecs.test_identical_input_gives_identical_bytes, toy)
    run_for(test_codecs.test_decode_writes_into_a_contiguous_out, toy)
    run_for(test_codecs.test_a_codec_is_registered_under_its_name_with_an_id_of_its_own, toy)
    run_for(test_receive_path.test_torch_path_decodes_into_out_without_an_intermediate_copy, toy)
    run_for(test_receive_path.test_layout_is_built_once_per_shape_and_dtype, toy)
    run_for(test_receive_path.test_a_codec_declaring_a_kernel_runs_on_the_triton_path_here, toy)
    run_for(test_graphs.test_replayed_encode_and_decode_equal_eager_and_read_nothing_on_the_host, toy)
    run_for(test_entropy.test_edge_case_buffers_round_trip_and_never_exceed_the_capacity, toy)


def test_bad_input(toy):
    assert run_for(test_codecs.test_edge_cases_round_trip_without_nan, toy) == 18  # 3 dtypes x 6 edge cases
    assert run_for(test_codecs.test_a_bad_value_decodes_to_nan_where_it_was_and_the_rest_stays_finite, toy) == 4
    run_for(test_codecs.test_unsupported_dtypes_and_empty_shapes_raise, toy)
    run_for(test_codecs.test_deferred_checks_count_foreign_headers_and_raise_later, toy)


def test_payload_checksum(toy):
    message = activation_like(test_checksum.SHAPE, dtype=torch.bfloat16, seed=3)
    run_for(test_checksum.test_clean_buffers_pass_and_decode_as_without_the_checksum, toy, message=message)
    run_for(test_checksum.test_every_corruption_raises_at_once_in_full_checks, toy, message=message)
    run_for(test_checksum.test_every_corruption_is_counted_on_the_device_in_deferred_checks, toy, message=message)


def test_statistics_and_its_row_in_the_codec_table(toy):
    run_for(test_stats.test_a_codecs_message_is_counted_before_and_on_the_wire_with_its_error, toy,
            sink=stats.Stats(places.STREAMS))
    run_for(test_codec_report.test_every_registered_codec_has_a_row_of_its_own_numbers, toy)
    assert (toy.name, toy.name, {}) in test_codec_report.report.stateless_rows()


def test_its_rows_in_the_generated_flag_table(toy):
    from scripts import write_flags

    run_for(test_arguments.test_every_codec_is_a_flag_value_its_options_config_fields_and_both_flag_table_rows, toy)
    page = write_flags.page()
    rows = [row for row in page.splitlines() if toy.name in row]
    assert [row.split(" | ")[0] for row in rows] == ["| `--tah-forward-codec`", "| `--tah-backward-codec`"]
    assert page != write_flags.PAGE.read_text()  # the committed page lacks it: write_flags --check would say so


def test_the_registry_is_as_it_was_after_a_test():
    from megatron_tah.codecs import CodecError, get_codec
    from megatron_tah.codecs.core.header import codec_name_for_id
    from megatron_tah.config import TahConfig

    assert Toy8Codec.name not in CODECS and codec_name_for_id(Toy8Codec.codec_id) == "unknown id 200"
    with pytest.raises(CodecError, match="unknown codec 'toy8'"):
        get_codec(Toy8Codec.name)
    with pytest.raises(ValueError, match="tah_forward_codec = 'toy8'"):
        TahConfig(tah_forward_codec=Toy8Codec.name)
