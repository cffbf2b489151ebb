"""The one /metrics page reader: samples by name and labels, sums, histogram buckets."""

from __future__ import annotations

import math

import pytest

from epdserve.common import metrics_text

PAGE = """# HELP vllm:num_requests_waiting Requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 3.0
# TYPE epdserve_router:requests_total counter
epdserve_router:requests_total{pod="a:8000",outcome="ok"} 7.0
epdserve_router:requests_total{pod="b:8000",outcome="ok"} 1.0
epdserve_router:requests_total{pod="b:8000",outcome="error"} 4.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf"} 5.0
vllm:time_to_first_token_seconds_count{engine="0"} 2.0
vllm:time_to_first_token_seconds_sum{engine="0"} 0.3
"""


def test_samples_keep_the_names_the_page_shows():
    names = {s.name for s in metrics_text.parse(PAGE)}
    assert "epdserve_router:requests_total" in names
    assert "vllm:time_to_first_token_seconds_bucket" in names


def test_total_sums_the_samples_whose_labels_include_the_given_ones():
    assert metrics_text.total(PAGE, "vllm:num_requests_waiting") == 5.0
    assert metrics_text.total(PAGE, "epdserve_router:requests_total", pod="b:8000") == 5.0
    assert metrics_text.total(PAGE, "epdserve_router:requests_total", outcome="ok") == 8.0
    assert metrics_text.total(PAGE, "epdserve_router:requests_total", pod="c:8000") == 0.0
    assert metrics_text.total(PAGE, "vllm:absent") == 0.0


def test_values_read_a_parsed_page_as_well_as_its_text():
    samples = metrics_text.parse(PAGE)
    assert metrics_text.values(samples, "vllm:num_requests_waiting", engine="1") == [3.0]
    assert metrics_text.values(PAGE, "vllm:num_requests_waiting", engine="1") == [3.0]


def test_buckets_are_summed_over_label_sets_by_upper_bound():
    family = "vllm:time_to_first_token_seconds"
    assert metrics_text.buckets(PAGE, family) == {0.1: 1.0, math.inf: 7.0}
    assert metrics_text.buckets(PAGE, family, engine="0") == {0.1: 1.0, math.inf: 2.0}


def test_a_malformed_page_is_refused():
    with pytest.raises(ValueError):
        metrics_text.parse("<html>not a metrics page</html>\n")


def test_only_the_named_families_are_read_and_the_rest_is_not_parsed():
    broken = PAGE + "epdserve:garbage{unterminated 1\n"
    with pytest.raises(ValueError):
        metrics_text.parse(broken)
    samples = metrics_text.parse(broken, only=["vllm:num_requests_waiting"])
    assert [s.value for s in samples] == [2.0, 3.0]
    assert {s.name for s in metrics_text.parse(PAGE, only=["vllm:time_to"])} == {
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_to_first_token_seconds_count",
        "vllm:time_to_first_token_seconds_sum",
    }
