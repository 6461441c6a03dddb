"""Delivery metrics: the tasks' tallies added up per destination and served on the collector's
/metrics when the pipeline runs in the same process (``headwater up``)."""

from __future__ import annotations

from headwater.collector.metrics import Metrics
from headwater.delivery.metrics import DeliveryMetrics, Tally


def test_tallies_add_up_and_are_served_beside_the_collectors() -> None:
    delivery = DeliveryMetrics()
    first, second = Tally(requests=3, retries=1, delivered=40, bytes=900, sessions=2), Tally()
    for seconds in (0.004, 0.03, 0.03):
        first.observe(seconds)
    second.observe(7.0)
    second.requests, second.sessions = 1, 1
    delivery.add("api", [Tally.from_json(first.to_json()), second])  # as commit messages carry
    collector = Metrics()
    collector.also.append(delivery.registry)
    text = collector.render().decode()
    assert 'headwater_delivery_requests_total{destination="api"} 4.0' in text
    assert 'headwater_delivery_events_total{destination="api"} 40.0' in text
    assert 'headwater_delivery_sessions{destination="api"} 3.0' in text
    assert 'headwater_delivery_request_seconds_bucket{destination="api",le="0.005"} 1.0' in text
    assert 'headwater_delivery_request_seconds_bucket{destination="api",le="0.05"} 3.0' in text
    assert 'headwater_delivery_request_seconds_bucket{destination="api",le="+Inf"} 4.0' in text
    assert 'headwater_delivery_request_seconds_count{destination="api"} 4.0' in text
    assert "headwater_collector_events_received" in text  # the collector's own are still there
