//! Who is being limited: the buckets with the most refusals (and the most throttled or warned
//! budget requests) over the last minute, in bounded memory whatever the key cardinality.
//!
//! A Space-Saving sketch (Metwally, Agrawal, El Abbadi, 2005) per 10-second slot, six slots in
//! a ring: a slot keeps at most [`TopSketch::capacity`] buckets; an event on a bucket it does
//! not hold replaces the bucket with the fewest events, which hands its count on (the newcomer
//! starts at that count plus one, and remembers it as its possible overcount). So in each slot
//! every bucket's count is exact or over by at most `events / capacity`, and every bucket with
//! more than `events / capacity` events is held. Summed over the slots of the last minute: a
//! listed count is over by at most `N / capacity` (N: events of the minute), and no bucket with
//! more than `N / capacity` events is missed.
//!
//! Pure: the caller passes the time; nothing here does I/O.

use std::sync::Arc;

/// Seconds one slot counts.
pub const SLOT_SECS: u64 = 10;
/// Slots in the ring: one minute.
pub const SLOTS: usize = 6;
/// Buckets one slot holds.
pub const DEFAULT_CAPACITY: usize = 128;

/// What happened to a request on a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    Refused,
    Throttled,
    Warned,
}

/// How a bucket is shown: its name (credential-like key parts masked), its rule and policy,
/// and the address an operator resets it at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Label {
    /// The name shown (credential-like key parts masked).
    pub bucket: String,
    /// The whole name, kept to resolve `/v1/buckets/by-hash/...`; never shown.
    pub name: String,
    pub rule: String,
    pub policy: String,
    /// `shadow` or `enforce`.
    pub mode: &'static str,
    /// The `/v1/buckets/...` path of this bucket.
    pub reset_path: String,
}

#[derive(Debug, Clone)]
struct Counted {
    key: u128,
    label: Arc<Label>,
    refused: u64,
    throttled: u64,
    warned: u64,
    /// The count of the bucket this one replaced: this bucket had at most that many events
    /// in the slot before it entered (its true count lies between its own counts and that
    /// plus this).
    overcount: u64,
}

impl Counted {
    fn total(&self) -> u64 {
        self.refused + self.throttled + self.warned + self.overcount
    }

    fn add(&mut self, event: Event) {
        match event {
            Event::Refused => self.refused += 1,
            Event::Throttled => self.throttled += 1,
            Event::Warned => self.warned += 1,
        }
    }
}

#[derive(Debug, Default)]
struct Slot {
    /// The 10-second period this slot counts (`unix secs / SLOT_SECS`).
    period: u64,
    events: u64,
    /// The largest count a bucket had when it was replaced: a bucket not held has had at most
    /// this many events (and at most the least count held, once the slot is full).
    evicted_max: u64,
    /// At most `capacity` buckets; a linear scan finds one (128 entries of 16-byte keys).
    counted: Vec<Counted>,
}

/// The sketch; see the module comment for its error bound.
#[derive(Debug)]
pub struct TopSketch {
    slots: [Slot; SLOTS],
    capacity: usize,
}

/// One bucket of [`TopSketch::top`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopEntry {
    pub label: Arc<Label>,
    pub refused: u64,
    pub throttled: u64,
    pub warned: u64,
    /// The bucket may have had up to this many more events than counted (0: exact): events
    /// in a slot before it entered that slot's sketch, or in a full slot that does not hold
    /// it.
    pub overcount: u64,
}

impl TopEntry {
    pub fn total(&self) -> u64 {
        self.refused + self.throttled + self.warned
    }
}

/// The answer to a query: the entries, and what bounds their error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Top {
    pub entries: Vec<TopEntry>,
    /// Events counted in the window (all buckets, all rules).
    pub events: u64,
    /// No count is over by more than this, and no bucket with more events is missing.
    pub error_bound: u64,
}

impl Default for TopSketch {
    fn default() -> Self {
        TopSketch::new(DEFAULT_CAPACITY)
    }
}

impl TopSketch {
    pub fn new(capacity: usize) -> Self {
        TopSketch {
            slots: Default::default(),
            capacity: capacity.max(1),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Most buckets held at once (every slot full).
    pub fn max_entries(&self) -> usize {
        self.capacity * SLOTS
    }

    /// Whether the current slot already holds `key` (then recording it needs no label).
    pub fn holds(&self, key: u128, unix_secs: u64) -> bool {
        let period = unix_secs / SLOT_SECS;
        let slot = &self.slots[(period % SLOTS as u64) as usize];
        slot.period == period && slot.counted.iter().any(|c| c.key == key)
    }

    /// Counts one event on bucket `key` at `unix_secs`; `label` is called only when the bucket
    /// enters the slot.
    pub fn record(
        &mut self,
        key: u128,
        event: Event,
        unix_secs: u64,
        label: impl FnOnce() -> Label,
    ) {
        let period = unix_secs / SLOT_SECS;
        let capacity = self.capacity;
        let slot = &mut self.slots[(period % SLOTS as u64) as usize];
        if slot.period != period {
            slot.period = period;
            slot.events = 0;
            slot.evicted_max = 0;
            slot.counted.clear();
        }
        slot.events += 1;
        if let Some(counted) = slot.counted.iter_mut().find(|c| c.key == key) {
            counted.add(event);
            return;
        }
        let mut fresh = Counted {
            key,
            label: Arc::new(label()),
            refused: 0,
            throttled: 0,
            warned: 0,
            overcount: 0,
        };
        fresh.add(event);
        if slot.counted.len() < capacity {
            // Room (never full yet, or a bucket was reset): it may have been replaced before.
            fresh.overcount = slot.evicted_max;
            slot.counted.push(fresh);
            return;
        }
        // Space-Saving: the newcomer takes the place (and the count) of the least counted.
        if let Some(least) = slot.counted.iter_mut().min_by_key(|c| c.total()) {
            fresh.overcount = least.total();
            slot.evicted_max = slot.evicted_max.max(least.total());
            *least = fresh;
        }
    }

    /// The `n` buckets with the most events in the last minute (the slots of the six 10-second
    /// periods up to `unix_secs`), optionally those of one rule, most first.
    pub fn top(&self, n: usize, rule: Option<&str>, unix_secs: u64) -> Top {
        let now = unix_secs / SLOT_SECS;
        let live = |slot: &&Slot| slot.period + (SLOTS as u64) > now && slot.period <= now;
        let mut merged: Vec<TopEntry> = Vec::new();
        let mut keys: Vec<u128> = Vec::new();
        let mut events = 0;
        // A full slot may have dropped a bucket with up to its least count of events; a slot
        // that never filled dropped nothing. Each bucket's overcount counts that floor for
        // every slot it is missing from, its inherited count for every slot holding it.
        let floor = |slot: &Slot| {
            let least = if slot.counted.len() < self.capacity {
                0
            } else {
                slot.counted.iter().map(Counted::total).min().unwrap_or(0)
            };
            least.max(slot.evicted_max)
        };
        let floors: u64 = self.slots.iter().filter(live).map(floor).sum();
        for slot in self.slots.iter().filter(live) {
            events += slot.events;
            let slot_floor = floor(slot);
            for c in &slot.counted {
                if rule.is_some_and(|r| c.label.rule != r) {
                    continue;
                }
                match keys.iter().position(|k| *k == c.key) {
                    Some(i) => {
                        let e = &mut merged[i];
                        e.refused += c.refused;
                        e.throttled += c.throttled;
                        e.warned += c.warned;
                        e.overcount = e.overcount - slot_floor + c.overcount;
                    }
                    None => {
                        keys.push(c.key);
                        merged.push(TopEntry {
                            label: Arc::clone(&c.label),
                            refused: c.refused,
                            throttled: c.throttled,
                            warned: c.warned,
                            overcount: floors - slot_floor + c.overcount,
                        });
                    }
                }
            }
        }
        merged.sort_by(|a, b| {
            (b.total() + b.overcount)
                .cmp(&(a.total() + a.overcount))
                .then_with(|| a.label.bucket.cmp(&b.label.bucket))
        });
        merged.truncate(n);
        Top {
            entries: merged,
            events,
            error_bound: events / self.capacity as u64,
        }
    }

    /// The label of bucket `key` if a slot of the last minute holds it.
    pub fn label_of(&self, key: u128, unix_secs: u64) -> Option<Arc<Label>> {
        let now = unix_secs / SLOT_SECS;
        self.slots
            .iter()
            .filter(|slot| slot.period + (SLOTS as u64) > now && slot.period <= now)
            .flat_map(|slot| slot.counted.iter())
            .find(|c| c.key == key)
            .map(|c| Arc::clone(&c.label))
    }

    /// Forgets a bucket (it was reset). The slot keeps what it knows of the buckets it replaced
    /// (its largest replaced count): one that enters the freed place may have had that many events.
    pub fn forget(&mut self, key: u128) {
        for slot in &mut self.slots {
            slot.counted.retain(|c| c.key != key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn label(name: &str) -> Label {
        Label {
            bucket: format!("tb:r:{name}"),
            name: format!("tb:r:{name}"),
            rule: "r".into(),
            policy: "p".into(),
            mode: "enforce",
            reset_path: String::new(),
        }
    }

    #[test]
    fn counts_are_exact_below_capacity_and_listed_most_first() {
        let mut sketch = TopSketch::new(4);
        for (key, times) in [(1u128, 5), (2, 9), (3, 1)] {
            for _ in 0..times {
                sketch.record(key, Event::Refused, 100, || label(&key.to_string()));
            }
        }
        sketch.record(3, Event::Warned, 101, || unreachable!("held already"));
        let top = sketch.top(2, None, 105);
        assert_eq!(top.events, 16);
        assert_eq!(top.error_bound, 4);
        let shown: Vec<(&str, u64, u64)> = top
            .entries
            .iter()
            .map(|e| (e.label.bucket.as_str(), e.refused, e.overcount))
            .collect();
        assert_eq!(shown, [("tb:r:2", 9, 0), ("tb:r:1", 5, 0)]);
    }

    #[test]
    fn the_window_is_the_last_minute() {
        let mut sketch = TopSketch::new(4);
        sketch.record(1, Event::Refused, 1_000, || label("old"));
        sketch.record(2, Event::Throttled, 1_055, || label("new"));
        assert_eq!(sketch.top(10, None, 1_055).entries.len(), 2);
        // 1 000 is in period 100; at 1 060 the window holds periods 101..=106.
        let top = sketch.top(10, None, 1_060);
        assert_eq!(top.entries.len(), 1);
        assert_eq!(top.entries[0].throttled, 1);
        assert_eq!(top.events, 1);
        // The slot of period 100 is reused by period 106.
        sketch.record(3, Event::Refused, 1_060, || label("reused"));
        assert_eq!(sketch.top(10, None, 1_060).entries.len(), 2);
    }

    #[test]
    fn one_rule_can_be_asked_for() {
        let mut sketch = TopSketch::new(4);
        sketch.record(1, Event::Refused, 0, || label("a"));
        sketch.record(2, Event::Refused, 0, || Label {
            rule: "other".into(),
            ..label("b")
        });
        let top = sketch.top(10, Some("other"), 0);
        assert_eq!(top.entries.len(), 1);
        assert_eq!(top.entries[0].label.bucket, "tb:r:b");
    }

    #[test]
    fn memory_is_bounded_by_capacity_whatever_the_cardinality() {
        let mut sketch = TopSketch::new(8);
        for key in 0..100_000u128 {
            sketch.record(key, Event::Refused, key as u64 / 1_000, || label("k"));
        }
        assert!(sketch.slots.iter().all(|s| s.counted.len() <= 8));
    }

    proptest! {
        /// Space-Saving's guarantee, checked against exact counts: every listed count is at
        /// least the true one and over by at most the bound, and every bucket with more events
        /// than the bound is listed.
        #[test]
        fn counts_stay_within_the_stated_bound(
            stream in proptest::collection::vec((0u128..40, 0u64..70), 1..600),
            capacity in 1usize..12,
        ) {
            let mut sketch = TopSketch::new(capacity);
            let mut stream = stream;
            stream.sort_by_key(|(_, t)| *t);
            let now = stream.last().map_or(0, |(_, t)| *t);
            let mut exact = std::collections::HashMap::<u128, u64>::new();
            for (key, t) in &stream {
                sketch.record(*key, Event::Refused, *t, || label(&key.to_string()));
                // Buckets 30 and up are reset now and then (and not checked below): the
                // others' bounds must hold through those resets.
                if *key >= 30 && t % 3 == 0 {
                    sketch.forget(*key);
                }
                if t / SLOT_SECS + SLOTS as u64 > now / SLOT_SECS {
                    *exact.entry(*key).or_default() += 1;
                }
            }
            let top = sketch.top(usize::MAX, None, now);
            prop_assert_eq!(top.events, exact.values().sum::<u64>());
            for e in &top.entries {
                let key = e.label.bucket[5..].parse::<u128>().unwrap();
                if key >= 30 {
                    continue;
                }
                let truth = exact.get(&key).copied().unwrap_or(0);
                prop_assert!(e.refused <= truth);
                prop_assert!(truth <= e.refused + e.overcount);
                prop_assert!(e.overcount <= top.error_bound);
            }
            for (key, truth) in &exact {
                if *key < 30 && *truth > top.error_bound {
                    let name = format!("tb:r:{key}");
                    prop_assert!(top.entries.iter().any(|e| e.label.bucket == name));
                }
            }
        }
    }
}
