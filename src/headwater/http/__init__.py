"""Outbound HTTP shared by HTTP delivery and webhooks."""
