"""Tests of broker."""
