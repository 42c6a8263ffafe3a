//! The bundle's lookup structures, built when it is compiled, so that finding what applies to a
//! request costs about the same with one policy, rule or kill switch as with a hundred thousand:
//! policies by host (a hash map), exact path (a hash map), path prefix (a segment trie) or method
//! (a hash map); a policy's rules by the value of the descriptor their `match` compares for
//! equality; kill switches by `(scope, value)` (a hash map) and, for address scopes, by network
//! (one hash map per prefix length). What cannot be indexed (a policy selected by nothing but
//! Envoy domains, a `match` on a network or on the host, a kill switch on an unreadable address)
//! stays a scan, over only those entries.
//!
//! The index only narrows the candidates: the engine still checks each one with its own
//! predicate ([`super::Selector::matches`], [`super::MatchCondition::matches`],
//! [`super::KillSwitch::hits`]) in bundle order, so answers are those of a plain scan (a
//! differential property test in the engine runs random bundles and requests both ways).

use super::rule::{KillSwitch, MatchValue, Policy, Rule};
use crate::request::descriptor::{Descriptor, IpNet, RequestFacts};
use ahash::AHashMap;
use smallvec::SmallVec;
use std::net::IpAddr;

/// Candidate positions (policies, rules or kill switches), in bundle order.
pub type Candidates = SmallVec<[u32; 16]>;

/// Set on a candidate rule whose indexed condition ([`indexed_condition`]) the index has
/// already compared, exactly, with the request's value: the engine does not ask it again (a
/// decision over a bundle of tiers would otherwise read the same header twice).
pub const VERIFIED: u32 = 1 << 31;

/// Positions sharing one key: most keys have one, kept inline.
type Positions = SmallVec<[u32; 2]>;

/// A value's 64-bit hash → the positions wanting that value. Keys are hashes, not copies of the
/// text: a bundle of 100 000 entries does not hold every value twice, and two values whose
/// hashes collide only make each other a candidate, which its own predicate then turns away.
type ByValue = AHashMap<u64, Positions>;

/// The key of a value in a [`ByValue`].
fn key(value: &str) -> u64 {
    twox_hash::XxHash3_64::oneshot(value.as_bytes())
}

/// The group of `key` among `groups` (added when missing): groups are few (one per descriptor or
/// prefix length in use), so a list beats a map.
fn group<'g, K: PartialEq + Clone>(groups: &'g mut Vec<(K, ByValue)>, key: &K) -> &'g mut ByValue {
    let at = match groups.iter().position(|(k, _)| k == key) {
        Some(at) => at,
        None => {
            groups.push((key.clone(), ByValue::default()));
            groups.len() - 1
        }
    };
    &mut groups[at].1
}

/// Every lookup structure of one bundle.
#[derive(Debug, Default)]
pub struct BundleIndex {
    policies: PolicyIndex,
    /// One per policy, in policy order.
    rules: Vec<RuleIndex>,
    kill_switches: KillSwitchIndex,
}

impl BundleIndex {
    pub fn build(policies: &[Policy], rules: &[Rule], kill_switches: &[KillSwitch]) -> Self {
        BundleIndex {
            policies: PolicyIndex::build(policies),
            rules: policies
                .iter()
                .map(|p| RuleIndex::build(&rules[p.rules.clone()], p.rules.start))
                .collect(),
            kill_switches: KillSwitchIndex::build(kill_switches),
        }
    }

    /// Bytes this index holds on the heap (tables at their capacity), for the memory figures.
    pub fn heap_bytes(&self) -> usize {
        fn map<K, V>(m: &AHashMap<K, V>) -> usize {
            m.capacity() * (std::mem::size_of::<(K, V)>() + 1)
        }
        let p = &self.policies;
        let policies = map(&p.by_host)
            + map(&p.by_exact_path)
            + map(&p.by_method)
            + p.scan.capacity() * 4
            + p.by_prefix
                .nodes
                .iter()
                .map(|n| {
                    map(&n.children) + n.entries.capacity() * 4 + std::mem::size_of::<TrieNode>()
                })
                .sum::<usize>();
        let rules = self
            .rules
            .iter()
            .map(|r| r.scan.capacity() * 4 + r.by_value.iter().map(|(_, m)| map(m)).sum::<usize>())
            .sum::<usize>();
        let k = &self.kill_switches;
        let switches = k.by_value.iter().map(|(_, m)| map(m)).sum::<usize>()
            + k.by_network.iter().map(|(_, m)| map(m)).sum::<usize>()
            + k.by_header_name
                .iter()
                .map(|(_, l)| l.capacity() * 4)
                .sum::<usize>();
        policies + rules + switches
    }

    /// The policies whose selector may match the request, in bundle order.
    pub fn policies(&self, facts: &RequestFacts<'_>, out: &mut Candidates) {
        self.policies.candidates(facts, out);
    }

    /// The regular rules of policy `policy` whose `match` may hold for the request, in bundle
    /// order; `None` when the request repeats a header one of them reads (the caller then
    /// scans, and refuses as it always has).
    pub fn rules(
        &self,
        rules: &[Rule],
        policy: usize,
        facts: &RequestFacts<'_>,
        default_v6_prefix: u8,
        out: &mut Candidates,
    ) -> Option<()> {
        self.rules
            .get(policy)?
            .candidates(rules, facts, default_v6_prefix, out)
    }

    /// The kill switches that may stop the request (whatever their expiry and route), in
    /// bundle order.
    pub fn kill_switches(
        &self,
        facts: &RequestFacts<'_>,
        default_v6_prefix: u8,
        out: &mut Candidates,
    ) {
        self.kill_switches.candidates(facts, default_v6_prefix, out);
    }

    /// The kill switches scoped on a header the request repeats, in bundle order.
    pub fn kill_switches_on_repeated_headers(
        &self,
        facts: &RequestFacts<'_>,
        out: &mut Candidates,
    ) {
        out.clear();
        if !facts.headers.repeats_any() {
            return;
        }
        for (name, switches) in &self.kill_switches.by_header_name {
            if facts.headers.is_repeated(name) {
                out.extend_from_slice(switches);
            }
        }
        out.sort_unstable();
    }
}

/// Candidates gathered from several lists, each already in bundle order: sorted at the end only
/// when more than one list contributed (each position is in one list).
struct Gather<'o> {
    out: &'o mut Candidates,
    lists: u8,
}

impl<'o> Gather<'o> {
    fn new(out: &'o mut Candidates) -> Self {
        out.clear();
        Gather { out, lists: 0 }
    }

    fn add(&mut self, list: &[u32]) {
        if !list.is_empty() {
            self.out.extend_from_slice(list);
            self.lists = self.lists.saturating_add(1);
        }
    }

    /// Adds the positions of `list` that `verified` confirms, marked [`VERIFIED`].
    fn add_verified(&mut self, list: &[u32], verified: impl Fn(u32) -> bool) {
        let before = self.out.len();
        self.out
            .extend(list.iter().filter(|&&p| verified(p)).map(|&p| p | VERIFIED));
        if self.out.len() > before {
            self.lists = self.lists.saturating_add(1);
        }
    }

    fn done(self) {
        if self.lists > 1 {
            self.out.sort_unstable_by_key(|p| p & !VERIFIED);
            self.out.dedup_by_key(|p| *p & !VERIFIED);
        }
    }
}

/// Policies by what selects them; each policy is in exactly one place.
#[derive(Debug, Default)]
struct PolicyIndex {
    /// Lower-case host → policies listing it.
    by_host: ByValue,
    by_exact_path: ByValue,
    by_prefix: PathTrie,
    /// Upper-case method → policies selected by methods alone.
    by_method: ByValue,
    /// Policies selected by nothing indexable (every request, or Envoy domains only).
    scan: Vec<u32>,
}

impl PolicyIndex {
    fn build(policies: &[Policy]) -> Self {
        let mut index = PolicyIndex::default();
        for (i, policy) in policies.iter().enumerate() {
            let i = i as u32;
            let s = &policy.selector;
            let prefix = s
                .path_prefix
                .as_deref()
                .filter(|p| !p.is_empty() && *p != "/");
            // A policy listing a name twice (or two names whose hashes collide) is kept once.
            let add = |map: &mut ByValue, value: &str| {
                let list = map.entry(key(value)).or_default();
                if list.last() != Some(&i) {
                    list.push(i);
                }
            };
            if let Some(hosts) = &s.hosts {
                for host in hosts {
                    add(&mut index.by_host, &host.to_ascii_lowercase());
                }
            } else if let Some(path) = &s.path_exact {
                index.by_exact_path.entry(key(path)).or_default().push(i);
            } else if let Some(prefix) = prefix.filter(|p| p.starts_with('/')) {
                index.by_prefix.insert(prefix, i);
            } else if let (Some(methods), None) = (&s.methods, prefix) {
                for method in methods {
                    add(&mut index.by_method, &method.to_ascii_uppercase());
                }
            } else {
                index.scan.push(i);
            }
        }
        index
    }

    fn candidates(&self, facts: &RequestFacts<'_>, out: &mut Candidates) {
        let mut out = Gather::new(out);
        out.add(&self.scan);
        if !self.by_host.is_empty() {
            if let Some(host) = facts.host_name() {
                let found = if host.bytes().any(|b| b.is_ascii_uppercase()) {
                    self.by_host.get(&key(&host.to_ascii_lowercase()))
                } else {
                    self.by_host.get(&key(host))
                };
                out.add(found.map_or(&[][..], |p| p.as_slice()));
            }
        }
        if !self.by_exact_path.is_empty() {
            if let Some(found) = self.by_exact_path.get(&key(&facts.path)) {
                out.add(found);
            }
        }
        self.by_prefix.walk(&facts.path, &mut out);
        if !self.by_method.is_empty() {
            let found = if facts.method.bytes().any(|b| b.is_ascii_lowercase()) {
                self.by_method.get(&key(&facts.method.to_ascii_uppercase()))
            } else {
                self.by_method.get(&key(facts.method))
            };
            out.add(found.map_or(&[][..], |p| p.as_slice()));
        }
        out.done();
    }
}

/// Path prefixes by segment: `/api/v1` is the node `api` → `v1`. A request's path walks down
/// its own segments and gathers every node it passes (segment-wise prefixes, as
/// [`super::path_has_prefix`] defines them).
#[derive(Debug, Default)]
struct PathTrie {
    nodes: Vec<TrieNode>,
}

#[derive(Debug, Default)]
struct TrieNode {
    /// A segment's hash → the child node.
    children: AHashMap<u64, u32>,
    entries: Vec<u32>,
}

impl PathTrie {
    fn insert(&mut self, prefix: &str, entry: u32) {
        if self.nodes.is_empty() {
            self.nodes.push(TrieNode::default());
        }
        let mut node = 0usize;
        for segment in prefix[1..].split('/') {
            let next = match self.nodes[node].children.get(&key(segment)) {
                Some(&n) => n as usize,
                None => {
                    let n = self.nodes.len();
                    self.nodes.push(TrieNode::default());
                    self.nodes[node].children.insert(key(segment), n as u32);
                    n
                }
            };
            node = next;
        }
        self.nodes[node].entries.push(entry);
    }

    fn walk(&self, path: &str, out: &mut Gather<'_>) {
        let (Some(root), Some(rest)) = (self.nodes.first(), path.strip_prefix('/')) else {
            return;
        };
        let mut node = root;
        for segment in rest.split('/') {
            match node.children.get(&key(segment)) {
                Some(&n) => {
                    node = &self.nodes[n as usize];
                    out.add(&node.entries);
                }
                None => return,
            }
        }
    }
}

/// One policy's regular rules by their `match`.
#[derive(Debug, Default)]
struct RuleIndex {
    /// Rules without an indexable condition (none at all, or only networks and hosts).
    scan: Vec<u32>,
    /// A descriptor → its value → the rules whose first indexable condition wants that value.
    by_value: Vec<(Descriptor, ByValue)>,
    /// Every header the policy's rules read: a request repeating one is scanned.
    headers: Vec<String>,
}

/// Whether a `match` condition compares its descriptor's value for plain equality (hosts and
/// domains compare in any case: left to the scan).
fn indexable<'r>(descriptor: &Descriptor, expected: &'r MatchValue) -> Option<&'r str> {
    match (descriptor, expected) {
        (Descriptor::Host | Descriptor::Domain, _)
        | (_, MatchValue::Network(_) | MatchValue::Pattern(_)) => None,
        (_, MatchValue::Text(value)) => Some(value),
    }
}

/// The condition a rule is indexed by: its first indexable one (position and wanted value).
pub fn indexed_condition(rule: &Rule) -> Option<(usize, &str)> {
    rule.conditions
        .iter()
        .enumerate()
        .find_map(|(k, c)| indexable(&c.descriptor, &c.expected).map(|v| (k, v)))
}

impl RuleIndex {
    fn build(rules: &[Rule], start: usize) -> Self {
        let mut index = RuleIndex::default();
        for (offset, rule) in rules.iter().enumerate() {
            let position = (start + offset) as u32;
            for name in &rule.header_names {
                if !index.headers.contains(name) {
                    index.headers.push(name.clone());
                }
            }
            let keyed = rule
                .conditions
                .iter()
                .find_map(|c| indexable(&c.descriptor, &c.expected).map(|v| (&c.descriptor, v)));
            match keyed {
                None => index.scan.push(position),
                Some((descriptor, value)) => group(&mut index.by_value, descriptor)
                    .entry(key(value))
                    .or_default()
                    .push(position),
            }
        }
        index
    }

    fn candidates(
        &self,
        rules: &[Rule],
        facts: &RequestFacts<'_>,
        default_v6_prefix: u8,
        out: &mut Candidates,
    ) -> Option<()> {
        if !self.headers.is_empty()
            && facts.headers.repeats_any()
            && self.headers.iter().any(|h| facts.headers.is_repeated(h))
        {
            return None;
        }
        let mut out = Gather::new(out);
        out.add(&self.scan);
        for (descriptor, by_value) in &self.by_value {
            if let Some(value) = descriptor.value(facts, default_v6_prefix) {
                if let Some(found) = by_value.get(&key(&value)) {
                    // Compared exactly here (two values whose hashes collide are not the
                    // same), so the engine need not read the descriptor again.
                    out.add_verified(found, |p| {
                        rules
                            .get(p as usize)
                            .and_then(indexed_condition)
                            .is_some_and(|(_, wanted)| wanted == value)
                    });
                }
            }
        }
        out.done();
        Some(())
    }
}

/// Kill switches by what they stop.
#[derive(Debug, Default)]
struct KillSwitchIndex {
    /// A scope → its value → switches.
    by_value: Vec<(Descriptor, ByValue)>,
    /// Address scopes: (IPv6, prefix length) → the canonical network → switches.
    by_network: Vec<((bool, u8), ByValue)>,
    /// Switches on a header, by header name (for the repeated-header refusal).
    by_header_name: Vec<(String, Vec<u32>)>,
}

impl KillSwitchIndex {
    fn build(switches: &[KillSwitch]) -> Self {
        let mut index = KillSwitchIndex::default();
        for (i, ks) in switches.iter().enumerate() {
            let i = i as u32;
            if let Descriptor::Header(name) = &*ks.scope {
                match index.by_header_name.iter_mut().find(|(n, _)| n == name) {
                    Some((_, list)) => list.push(i),
                    None => index.by_header_name.push((name.clone(), vec![i])),
                }
            }
            let network = match &*ks.scope {
                Descriptor::Ip { .. } => IpNet::parse(&ks.value),
                _ => None,
            };
            match network {
                Some(net) => group(&mut index.by_network, &(net.addr().is_ipv6(), net.prefix()))
                    .entry(key(&net.canonical()))
                    .or_default()
                    .push(i),
                None => group(&mut index.by_value, &ks.scope)
                    .entry(key(&ks.value))
                    .or_default()
                    .push(i),
            }
        }
        index
    }

    fn candidates(&self, facts: &RequestFacts<'_>, default_v6_prefix: u8, out: &mut Candidates) {
        let mut out = Gather::new(out);
        for (scope, by_value) in &self.by_value {
            if let Some(value) = scope.value(facts, default_v6_prefix) {
                if let Some(found) = by_value.get(&key(&value)) {
                    out.add(found);
                }
            }
        }
        if let (Some(ip), false) = (facts.client_ip, self.by_network.is_empty()) {
            if let Some(ip) = IpNet::parse(&ip.to_string()) {
                let v6 = matches!(ip.addr(), IpAddr::V6(_));
                for ((is_v6, prefix), by_net) in &self.by_network {
                    if *is_v6 == v6 {
                        if let Some(found) = by_net.get(&key(&ip.with_prefix(*prefix).canonical()))
                        {
                            out.add(found);
                        }
                    }
                }
            }
        }
        out.done();
    }
}
