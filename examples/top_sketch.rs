//! What `/v1/top`'s sketch costs: the heap it holds once every slot is full (counted by the
//! allocator, whatever the key cardinality), and the time one refusal spends in it, for a
//! bucket the current slot already holds (an attacker hammering one key) and for a new bucket
//! every time (a flood of distinct keys: the least-counted entry is replaced and a label
//! built). Run by hand:
//!
//! ```sh
//! cargo run --release --example top_sketch
//! ```

// A measuring tool: a panic is how it reports a broken setup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "common/counting.rs"]
mod counting;
use counting::LIVE;
use std::sync::atomic::Ordering;
use std::time::Instant;
use tollgate::operator::top::{Event, Label, TopSketch, SLOTS, SLOT_SECS};

/// A label as the gateway builds one for `tb:per-ip:<IPv4>` (name, shown name, reset path).
fn label(i: u64) -> Label {
    let name = format!(
        "tb:per-ip:10.{}.{}.{}",
        (i >> 16) & 255,
        (i >> 8) & 255,
        i & 255
    );
    Label {
        bucket: name.clone(),
        reset_path: format!("/v1/buckets/{name}"),
        name,
        rule: "per-ip".to_string(),
        policy: "api".to_string(),
        mode: "enforce",
    }
}

fn main() {
    let before = LIVE.load(Ordering::Relaxed);
    let mut sketch = TopSketch::default();
    // A minute of floods: 200 000 distinct buckets in every 10-second slot.
    let per_slot = 200_000u64;
    let started = Instant::now();
    for slot in 0..SLOTS as u64 {
        for i in 0..per_slot {
            let key = u128::from(slot * per_slot + i);
            sketch.record(key, Event::Refused, slot * SLOT_SECS, || label(key as u64));
        }
    }
    let miss_ns = started.elapsed().as_nanos() as f64 / (SLOTS as u64 * per_slot) as f64;
    let held = LIVE.load(Ordering::Relaxed).saturating_sub(before);
    // One bucket refused again and again (the current slot holds it).
    let now = (SLOTS as u64 - 1) * SLOT_SECS;
    let hot = u128::from((SLOTS as u64 - 1) * per_slot + per_slot - 1);
    let n = 5_000_000u64;
    let started = Instant::now();
    for _ in 0..n {
        sketch.record(hot, Event::Refused, now, || label(0));
    }
    let hit_ns = started.elapsed().as_nanos() as f64 / n as f64;
    let top = sketch.top(10, None, now);
    println!(
        "sketch: {} buckets at most ({} per slot × {} slots); heap held when full: {} bytes ({:.0} per bucket)",
        sketch.max_entries(),
        sketch.capacity(),
        SLOTS,
        held,
        held as f64 / sketch.max_entries() as f64
    );
    println!("refusal on a bucket the slot holds: {hit_ns:.1} ns; on a new bucket (replace the least, build its label): {miss_ns:.1} ns");
    println!(
        "after the flood: {} events, error bound {}, top count {}",
        top.events,
        top.error_bound,
        top.entries.first().map_or(0, |e| e.refused)
    );
}
