//! Tests of local mode.
