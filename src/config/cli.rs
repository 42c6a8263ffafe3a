//! Command line (clap): every `run` flag can also come from a `TOLLGATE_*` environment
//! variable. `validate` and `simulate` are implemented here; `run` hands a resolved
//! configuration to the gateway; `publish`, `promote`, `rollback` and `fleet` take their flags
//! from here and run in [`crate::fleet::commands`].

use crate::engine::EngineConfig;
use crate::policy::{load_file, PolicyError};
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::io::{BufReader, Write};
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "tollgate",
    version,
    about = "Edge API gateway: rate limits, quotas and kill switches as JSON policy",
    after_help = "Every flag of `run` can also come from its TOLLGATE_* environment variable.\n\
                  `tollgate help <command>` shows a command's flags, grouped, with defaults and\n\
                  examples. The manual: docs/src (an mdBook; built into target/book)."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the gateway: reverse proxy (with --upstream) and admin/decision listener.
    #[command(after_help = RUN_EXAMPLES)]
    Run(Box<RunArgs>),
    /// Check policy bundles; exit 0 when all are valid, 1 with every error otherwise.
    #[command(after_help = VALIDATE_EXAMPLES)]
    Validate(ValidateArgs),
    /// Replay JSON-lines requests through the engine on a virtual clock.
    #[command(after_help = SIMULATE_EXAMPLES)]
    Simulate(SimulateArgs),
    /// Convert another limiter's configuration into a tollgate bundle (JSON on stdout; what
    /// could not be carried over exactly on stderr).
    #[command(subcommand, after_help = IMPORT_EXAMPLES)]
    Import(ImportCommand),
    /// Validate a bundle, sign it and store it for the whole fleet (as live, or as the
    /// candidate with --candidate); prints the new version.
    #[command(after_help = PUBLISH_EXAMPLES)]
    Publish(PublishArgs),
    /// Make the store's candidate live, as a new version (re-signed); prints the version.
    #[command(after_help = PROMOTE_EXAMPLES)]
    Promote(PromoteArgs),
    /// Publish the previous live bundle again as live, as a new version; prints the version.
    #[command(after_help = ROLLBACK_EXAMPLES)]
    Rollback(PromoteArgs),
    /// Seal the live bundle again under a new version with a new expiry (--valid-for),
    /// re-signed; prints the version. Run it before the live bundle expires.
    #[command(after_help = REFRESH_EXAMPLES)]
    Refresh(PromoteArgs),
    /// Which gateway runs which bundle: one line per gateway from their heartbeats.
    #[command(after_help = FLEET_EXAMPLES)]
    Fleet(FleetArgs),
    /// Repair a policy store written by someone without the signing key: the version record
    /// set back to the highest believable version, heartbeats from the future removed.
    #[command(after_help = REPAIR_EXAMPLES)]
    Repair(RepairArgs),
}

/// `tollgate help run`'s examples (each line after a comment is parsed by a unit test).
const RUN_EXAMPLES: &str = "Examples:
  # In front of an API, its buckets kept across restarts, crashes and upgrades:
  tollgate run --policy policies/axum-per-ip.json --upstream 127.0.0.1:3000 --state-dir /var/lib/tollgate
  # A decision service only, for nginx auth_request (POST /v1/decision on the admin listener):
  tollgate run --policy policies/jwt-tiers.json --admin-listen 127.0.0.1:9090
  # HTTPS and HTTP/2 in front, routes to several upstream groups:
  tollgate run --policy policies/axum-per-ip.json --routes examples/gateway/routes.json --listen-tls 0.0.0.0:8443 --tls-cert cert.pem --tls-key key.pem
  # Envoy's rate-limit service over gRPC, for envoyproxy/ratelimit users:
  tollgate run --policy policies/envoy-ratelimit.json --grpc-listen 0.0.0.0:8081
  # One of a fleet sharing its buckets on Redis:
  tollgate run --policy policies/axum-per-ip.json --upstream 10.0.0.5:8080 --store redis://10.0.0.9:6379
  # Replace a running gateway without closing its listeners (then SIGQUIT the old process):
  tollgate run --policy policies/axum-per-ip.json --upstream 127.0.0.1:3000 --state-dir /var/lib/tollgate --upgrade";

const VALIDATE_EXAMPLES: &str = "Examples:
  # Every shipped policy:
  tollgate validate policies/coinbase.json policies/llm-tiers.json
  # Also warn about state a restart would reset without the state dir run will use:
  tollgate validate --state-dir /var/lib/tollgate policies/fairvisor-budgets.json";

const SIMULATE_EXAMPLES: &str = "Examples:
  # The Coinbase worked example, replayed to the digit:
  tollgate simulate --policy policies/coinbase-worked-example.json --requests examples/coinbase-worked-example-requests.jsonl
  # A recorded LLM conversation against the tiers (usage settled as it was reported):
  tollgate simulate --policy policies/llm-tiers.json --requests examples/llm-conversation.jsonl";

const IMPORT_EXAMPLES: &str = "Examples:
  # An envoyproxy/ratelimit configuration, as a bundle for tollgate's gRPC service:
  tollgate import envoy-ratelimit examples/envoy/ratelimit-config.yaml";

// `tollgate publish`, `promote`, `rollback` and `fleet` (run by [`crate::fleet::commands`]):
// their flags and examples.

/// `tollgate publish`'s examples (each line after a comment is parsed by a unit test).
pub const PUBLISH_EXAMPLES: &str = "Examples:
  # Make a signing key, once (give its public half to the gateways' --policy-verify-key):
  #   openssl genpkey -algorithm ed25519 -out bundle-sign.pem
  #   openssl pkey -in bundle-sign.pem -pubout -out bundle-verify.pem
  # Publish a bundle as live for the whole fleet; the new version is printed:
  tollgate publish policies/coinbase.json --store redis://10.0.0.9:6379 --sign-key bundle-sign.pem
  # Publish it as the candidate the gateways evaluate in shadow beside the live one:
  tollgate publish policies/coinbase.json --store postgres://tollgate@10.0.0.9/tollgate --sign-key bundle-sign.pem --candidate
  # Write the envelope to a file instead, for a static HTTP(S) server to serve:
  tollgate publish policies/coinbase.json --out /srv/www/bundle.json --sign-key bundle-sign.pem";

/// `tollgate promote`'s examples.
pub const PROMOTE_EXAMPLES: &str = "Examples:
  # The candidate becomes live (a new version, re-signed); prints the version:
  tollgate promote --store redis://10.0.0.9:6379 --sign-key bundle-sign.pem";

/// `tollgate rollback`'s examples.
pub const ROLLBACK_EXAMPLES: &str = "Examples:
  # The previous live bundle is published again as live, under a new version:
  tollgate rollback --store redis://10.0.0.9:6379 --sign-key bundle-sign.pem
  # Once more: the one before it (each rollback goes one bundle further back)
  tollgate rollback --store redis://10.0.0.9:6379 --sign-key bundle-sign.pem";

/// `tollgate refresh`'s examples.
pub const REFRESH_EXAMPLES: &str = "Examples:
  # The live bundle sealed again, valid for another 30 days (daily from cron keeps it valid):
  tollgate refresh --store redis://10.0.0.9:6379 --sign-key bundle-sign.pem
  # A shorter validity narrows how long an old bundle could be put back:
  tollgate refresh --store redis://10.0.0.9:6379 --sign-key bundle-sign.pem --valid-for 2d";

/// `tollgate repair`'s examples.
pub const REPAIR_EXAMPLES: &str = "Examples:
  # Set the version record back and drop heartbeats from the future; prints the record:
  tollgate repair --store redis://10.0.0.9:6379";

/// `tollgate fleet`'s examples.
pub const FLEET_EXAMPLES: &str =
    "Columns: GATEWAY (--gateway-id), LIVE (its live version), HASH (the first 12 hex
digits of that bundle's SHA-256), CANDIDATE (its candidate's version, or -), SEEN (age of
its last heartbeat), WOULD-REFUSE (requests its candidate would have refused), STATE
(following, unreachable or starting).

Examples:
  # Which gateway runs which bundle:
  tollgate fleet --store redis://10.0.0.9:6379
  # The same as one JSON document, for scripts:
  tollgate fleet --store postgres://tollgate@10.0.0.9/tollgate --json";

/// The store flag and its deadline, shared by the four commands.
#[derive(Debug, Args)]
pub struct StoreArgs {
    /// Policy store: `redis://HOST:PORT[/DB]`, `redis+cluster://HOST:PORT[,...]` or
    /// `postgres://...` (the URLs `run --store` takes). `publish` takes --out instead.
    #[arg(long, value_name = "URL")]
    pub store: Option<String>,
    /// Deadline of each call to the store, in milliseconds.
    #[arg(long, default_value_t = 5000)]
    pub timeout_ms: u64,
}

#[derive(Debug, Args)]
pub struct SigningArgs {
    /// Ed25519 private key (PKCS#8 PEM, as `openssl genpkey -algorithm ed25519` writes it)
    /// to sign the bundle with.
    #[arg(long, value_name = "PEM")]
    pub sign_key: Option<PathBuf>,
    /// Without --sign-key: replace a signed live bundle (or promote a signed candidate) by an
    /// unsigned one anyway. Gateways with --policy-verify-key refuse unsigned bundles.
    #[arg(long)]
    pub allow_unsigned: bool,
    /// How long the sealed envelope is valid (covered by the signature): gateways refuse it
    /// after that, and warn a week ahead. `tollgate refresh` seals it again.
    #[arg(long, value_name = "DURATION", default_value = "30d")]
    pub valid_for: humantime::Duration,
}

#[derive(Debug, Args)]
pub struct PublishArgs {
    /// The bundle file (validated as `tollgate validate` does).
    pub file: PathBuf,
    #[command(flatten)]
    pub store: StoreArgs,
    /// Write the envelope to this file instead of a store (for any static HTTP(S) server to
    /// serve to `run --policy-store https://...`); its version grows past the file's own.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["store", "candidate"])]
    pub out: Option<PathBuf>,
    /// Publish as the candidate (evaluated in shadow by every gateway) instead of live.
    #[arg(long)]
    pub candidate: bool,
    #[command(flatten)]
    pub signing: SigningArgs,
}

#[derive(Debug, Args)]
pub struct PromoteArgs {
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub signing: SigningArgs,
}

#[derive(Debug, Args)]
pub struct RepairArgs {
    #[command(flatten)]
    pub store: StoreArgs,
}

#[derive(Debug, Args)]
pub struct FleetArgs {
    #[command(flatten)]
    pub store: StoreArgs,
    /// One JSON document (the store's live and candidate, every heartbeat) instead of the table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum ImportCommand {
    /// An envoyproxy/ratelimit YAML configuration, for tollgate's gRPC rate-limit service.
    EnvoyRatelimit {
        /// The YAML file.
        file: PathBuf,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Policy bundle (JSON). Reloaded on SIGHUP and when the file changes.
    #[arg(
        help_heading = "Policy",
        long,
        env = "TOLLGATE_POLICY",
        required_unless_present = "policy_store",
        conflicts_with = "policy_store"
    )]
    pub policy: Option<PathBuf>,
    /// Follow the fleet's published bundle instead of a file: redis://, redis+cluster://,
    /// postgres:// (as `tollgate publish` writes them) or an http(s):// URL serving one
    /// envelope. The new version is served within about a second of its publication.
    #[arg(help_heading = "Policy", long, env = "TOLLGATE_POLICY_STORE")]
    pub policy_store: Option<String>,
    /// Ed25519 public key (PEM, as `openssl pkey -pubout` writes it): with it, only bundles
    /// signed by the matching `--sign-key` are put in force.
    #[arg(
        help_heading = "Policy",
        long,
        env = "TOLLGATE_POLICY_VERIFY_KEY",
        requires = "policy_store"
    )]
    pub policy_verify_key: Option<PathBuf>,
    /// Follow --policy-store without --policy-verify-key: put in force unsigned bundles that
    /// anyone able to write the store could have written (start-up warns). Without a verify
    /// key and without this flag, start-up fails.
    #[arg(
        help_heading = "Policy",
        long,
        env = "TOLLGATE_ALLOW_UNSIGNED_BUNDLES",
        requires = "policy_store"
    )]
    pub allow_unsigned_bundles: bool,
    /// This gateway's name in the policy store's heartbeats (`tollgate fleet`) and in a shared
    /// --store's list of gateways present; default: the host name and the --listen port.
    #[arg(help_heading = "Policy", long, env = "TOLLGATE_GATEWAY_ID")]
    pub gateway_id: Option<String>,
    /// Largest published bundle envelope read from --policy-store; a larger one is refused
    /// and the bundle in force kept.
    #[arg(
        help_heading = "Policy",
        long,
        env = "TOLLGATE_POLICY_STORE_MAX_BYTES",
        default_value_t = crate::fleet::envelope::DEFAULT_MAX_BYTES
    )]
    pub policy_store_max_bytes: usize,
    /// Proxy listener address.
    #[arg(
        help_heading = "Listeners and upstreams",
        long,
        env = "TOLLGATE_LISTEN",
        default_value = "0.0.0.0:8080"
    )]
    pub listen: String,
    /// Upstream(s) HOST:PORT, round-robin. Without it (or --routes) only the admin listener runs.
    #[arg(
        help_heading = "Listeners and upstreams",
        long,
        env = "TOLLGATE_UPSTREAM",
        value_delimiter = ',',
        conflicts_with = "routes"
    )]
    pub upstream: Vec<String>,
    /// Gateway file (JSON): named upstream groups (servers, balancing, HTTPS, timeouts, health
    /// checks) and the host/path routes to them. Reloaded on SIGHUP and when it changes.
    #[arg(
        help_heading = "Listeners and upstreams",
        long,
        env = "TOLLGATE_ROUTES"
    )]
    pub routes: Option<PathBuf>,
    /// Admin listener: /v1/decision, /livez, /readyz, /metrics, and with --admin-token the
    /// operator endpoints (/v1/buckets, /v1/explain, /v1/top, /status).
    #[arg(
        help_heading = "Listeners and upstreams",
        long,
        env = "TOLLGATE_ADMIN_LISTEN",
        default_value = "127.0.0.1:9090"
    )]
    pub admin_listen: String,
    /// When a listener's address is in use at start-up (or one an upgrade adds), try again once
    /// a second, up to 30 times, before giving up. Without it, start-up stops at once with exit
    /// code 1 and one line naming the address. Nothing is served while it waits.
    #[arg(
        help_heading = "Listeners and upstreams",
        long,
        env = "TOLLGATE_BIND_RETRY"
    )]
    pub bind_retry: bool,
    /// Turns the operator endpoints on: they answer requests sending
    /// `Authorization: Bearer TOKEN` (at least 16 characters; best from the environment or
    /// --admin-token-file). Without it they answer 403.
    #[arg(
        help_heading = "Operators and logs",
        long,
        env = "TOLLGATE_ADMIN_TOKEN",
        hide_env_values = true,
        conflicts_with = "admin_token_file"
    )]
    pub admin_token: Option<String>,
    /// --admin-token read from a file (its first line), so it never shows in `ps`.
    #[arg(
        help_heading = "Operators and logs",
        long,
        env = "TOLLGATE_ADMIN_TOKEN_FILE"
    )]
    pub admin_token_file: Option<PathBuf>,
    /// Where a budget rule's `notify_at` thresholds are announced: a signed JSON POST (header
    /// `X-Tollgate-Signature: sha256=<HMAC>`) once per key, threshold and window for the whole
    /// fleet, retried with backoff. http:// or https://; needs --webhook-secret-file.
    #[arg(
        help_heading = "Operators and logs",
        long,
        env = "TOLLGATE_WEBHOOK_URL"
    )]
    pub webhook_url: Option<String>,
    /// The HMAC-SHA256 key --webhook-url's signatures are made with: the file's first line, at
    /// least 16 bytes.
    #[arg(
        help_heading = "Operators and logs",
        long,
        env = "TOLLGATE_WEBHOOK_SECRET_FILE"
    )]
    pub webhook_secret_file: Option<PathBuf>,
    /// Scoped operator tokens: a JSON list of {"id", "scopes", "token" or "token_sha256"}
    /// (scopes: read, reset, overrides, usage, debug), owner-only (chmod 600). A token outside
    /// its scopes gets 403. With --admin-token too, that token keeps every scope. Read again on
    /// SIGHUP.
    #[arg(
        help_heading = "Operators and logs",
        long,
        env = "TOLLGATE_ADMIN_TOKENS_FILE"
    )]
    pub admin_tokens_file: Option<PathBuf>,
    /// Append one JSON line per operator write (reset, override, debug session, bundle
    /// change) to this file, created owner-only. Without it the lines go to the log
    /// (target tollgate::audit).
    #[arg(help_heading = "Operators and logs", long, env = "TOLLGATE_AUDIT_LOG")]
    pub audit_log: Option<PathBuf>,
    /// Answer as Fairvisor Edge does where tollgate differs on purpose (the manual: "From
    /// Fairvisor Edge"): `X-Fairvisor-*` header names, the reason header only for debug sessions,
    /// `fairvisor_*` metrics beside tollgate's, Fairvisor's unverified-JWT reading.
    #[arg(
        help_heading = "Policy",
        long,
        env = "TOLLGATE_COMPAT",
        value_enum,
        default_value = "none"
    )]
    pub compat: CompatArg,
    /// With --compat fairvisor: the secret `POST /v1/debug/session` takes in
    /// `X-Fairvisor-Debug-Secret` to open a debug session (an `fv_dbg` cookie, 15 minutes,
    /// ended by `POST /v1/debug/logout`). At least 16 printable characters; 5 failed attempts
    /// from a client in 5 minutes make it wait (429). Without it the debug endpoints answer 404.
    #[arg(
        help_heading = "Policy",
        long,
        env = "TOLLGATE_DEBUG_SESSION_SECRET",
        hide_env_values = true,
        conflicts_with = "debug_session_secret_file"
    )]
    pub debug_session_secret: Option<String>,
    /// --debug-session-secret read from a file (its trailing newline dropped), so it never
    /// shows in `ps`.
    #[arg(
        help_heading = "Policy",
        long,
        env = "TOLLGATE_DEBUG_SESSION_SECRET_FILE"
    )]
    pub debug_session_secret_file: Option<PathBuf>,
    /// MaxMind-format database for `ip:country` (GeoLite2/GeoIP2 Country or City, DB-IP lite)
    /// or `ip:asn` (GeoLite2 ASN); repeat it for both. A database answers before the trusted
    /// headers. Verified whole at load; reloaded on SIGHUP and when it changes.
    #[arg(
        help_heading = "Who the client is",
        long = "geoip-db",
        env = "TOLLGATE_GEOIP_DB",
        value_delimiter = ','
    )]
    pub geoip_db: Vec<PathBuf>,
    /// ASN → type map for the `ip:type` descriptor, in nginx `map` format (`72 business;`,
    /// `default unknown;`). Reloaded on SIGHUP and when it changes; a bad file keeps the last
    /// good one.
    #[arg(
        help_heading = "Who the client is",
        long,
        env = "TOLLGATE_ASN_TYPE_MAP"
    )]
    pub asn_type_map: Option<PathBuf>,
    /// Tor exit list for the `ip:tor` descriptor: one address or CIDR per line (or nginx `geo`
    /// lines `1.2.3.4 1;`). Reloaded on SIGHUP and when it changes.
    #[arg(help_heading = "Who the client is", long, env = "TOLLGATE_TOR_EXITS")]
    pub tor_exits: Option<PathBuf>,
    /// Take a network file (--geoip-db, --asn-type-map, --tor-exits) that comes back empty, or
    /// with fewer than half the entries in force, at a reload. Without it such a reload is
    /// refused (ERROR log, tollgate_network_reloads_rejected_total) and the data in force kept.
    #[arg(
        help_heading = "Who the client is",
        long,
        env = "TOLLGATE_NETWORK_ALLOW_SHRINK"
    )]
    pub network_allow_shrink: bool,
    /// Start even when --policy does not exist yet (an orchestrator mounts it later): until a
    /// valid bundle appears, the proxy forwards everything unlimited and decisions answer 503.
    /// Without it, a missing policy file stops start-up with exit code 1.
    #[arg(help_heading = "Policy", long, env = "TOLLGATE_WAIT_FOR_POLICY")]
    pub wait_for_policy: bool,
    /// Accept a policy file that puts nothing in force (no policy and no kill switch: an empty
    /// bundle, or every policy left out by --skip-invalid-policies), which proxies everything
    /// unlimited. Without it such a file stops start-up with exit code 1, and a reload to it is
    /// refused (the bundle in force is kept).
    #[arg(help_heading = "Policy", long, env = "TOLLGATE_ALLOW_EMPTY_POLICY")]
    pub allow_empty_policy: bool,
    /// Worker threads of the proxy service.
    #[arg(
        help_heading = "Listeners and upstreams",
        long,
        env = "TOLLGATE_THREADS",
        default_value_t = 2
    )]
    pub threads: usize,
    /// Bucket store: `memory` (embedded, default), or one shared by a fleet: `redis://HOST:PORT[/DB]`,
    /// `redis+cluster://HOST:PORT,...`, `redis+sentinel://HOST:PORT,.../SERVICE` or `postgres://...`.
    #[arg(
        help_heading = "Buckets and stores",
        long,
        env = "TOLLGATE_STORE",
        default_value = "memory"
    )]
    pub store: String,
    /// Deadline of one call to a networked store, in milliseconds; past it the request is
    /// decided by its rule's `on_store_error` (see --on-store-error).
    #[arg(
        help_heading = "Buckets and stores",
        long,
        env = "TOLLGATE_STORE_TIMEOUT_MS",
        default_value_t = 5
    )]
    pub store_timeout_ms: u64,
    /// What a rule without its own `on_store_error` does while a shared --store does not
    /// answer: `local` (decide from this gateway's share of the limit, charge the store later),
    /// `open` (admit, spend nothing) or `closed` (refuse with 503).
    #[arg(
        help_heading = "Buckets and stores",
        long,
        env = "TOLLGATE_ON_STORE_ERROR",
        default_value = "local",
        value_parser = ["local", "open", "closed"]
    )]
    pub on_store_error: String,
    /// Most buckets a shared --store's local mirror holds (this gateway's shares, used while
    /// the store does not answer).
    #[arg(
        help_heading = "Buckets and stores",
        long,
        env = "TOLLGATE_LOCAL_MAX_BUCKETS",
        default_value_t = 100_000
    )]
    pub local_max_buckets: usize,
    /// Most buckets the embedded store holds.
    #[arg(
        help_heading = "Buckets and stores",
        long,
        env = "TOLLGATE_MAX_BUCKETS",
        default_value_t = 1_000_000
    )]
    pub max_buckets: usize,
    /// Most loop-detection marks the embedded store holds (one per admitted request under
    /// `loop_detection`, for its window), apart from its buckets, concurrency slots and breakers.
    /// At the bound the mark expiring soonest of a few sampled is forgotten: one identical
    /// request a loop count misses. About 43 bytes each (84 in the table's slots at most).
    #[arg(
        help_heading = "Buckets and stores",
        long,
        env = "TOLLGATE_MAX_LOOP_MARKS",
        default_value_t = crate::store::marks::DEFAULT_MAX_LOOP_MARKS
    )]
    pub max_loop_marks: usize,
    /// Most requests waiting at once for their turn under token-bucket rules' `delay`, on this
    /// gateway (each key's own bound is its rule's burst). A request that would wait beyond it
    /// is refused, as a request past the burst is.
    #[arg(
        help_heading = "Buckets and stores",
        long,
        env = "TOLLGATE_MAX_DELAYED_REQUESTS",
        default_value_t = 10_000
    )]
    pub max_delayed_requests: usize,
    /// Accepted for compatibility and ignored: a bucket that is not full again is never dropped
    /// for being idle (a flood of fresh keys must not reset anyone's limit or budget).
    #[arg(
        help_heading = "Buckets and stores",
        long,
        env = "TOLLGATE_BUCKET_IDLE_SECS",
        hide = true
    )]
    pub bucket_idle_secs: Option<u64>,
    /// Keep the embedded store's buckets, budgets, breakers, loop marks and reservations in
    /// files under DIR (mapped into memory): they survive a restart, a crash of the process and
    /// an upgrade. One gateway per directory. It must be owned by this user or root and
    /// writable by nobody else (nor replaceable through a directory above it), or start-up stops.
    #[arg(help_heading = "Buckets and stores", long, env = "TOLLGATE_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// With --state-dir: milliseconds between flushes of the state file to disk, the most a
    /// crash of the machine (not of the process) can lose.
    #[arg(
        help_heading = "Buckets and stores",
        long,
        env = "TOLLGATE_STATE_SYNC_MS",
        default_value_t = 1000
    )]
    pub state_sync_ms: u64,
    /// Take the listening sockets over from the running gateway (zero-downtime upgrade): start
    /// this process, then send the old one SIGQUIT; it hands its listeners over through
    /// --upgrade-sock and, once this one confirms it serves, finishes its requests in flight and
    /// exits. This process loads everything first and exits 1 without taking the listeners if
    /// anything (the policy included) fails to load.
    #[arg(help_heading = "Buckets and stores", long, env = "TOLLGATE_UPGRADE")]
    pub upgrade: bool,
    /// The Unix socket the listeners are handed over through (the old and the new process must
    /// name the same one), in a directory only this user (or root) owns and can write: another
    /// is refused at start-up. Both ends accept only this user or root as the other. Default:
    /// `upgrade.sock` in --state-dir; without either, SIGQUIT is logged and ignored.
    #[arg(
        help_heading = "Buckets and stores",
        long,
        env = "TOLLGATE_UPGRADE_SOCK"
    )]
    pub upgrade_sock: Option<PathBuf>,
    /// Seconds between sweeps of full-again buckets and expired leases.
    #[arg(
        help_heading = "Buckets and stores",
        long,
        env = "TOLLGATE_SWEEP_INTERVAL_SECS",
        default_value_t = 60
    )]
    pub sweep_interval_secs: u64,
    /// CIDR whose peers may set X-Forwarded-For, and the network headers (X-Country-Code, X-ASN,
    /// X-ASN-Type, X-Tor-Exit), on the proxy and the decision service (repeatable or
    /// comma-separated).
    #[arg(
        help_heading = "Who the client is",
        long = "trusted-proxy",
        env = "TOLLGATE_TRUSTED_PROXY",
        value_delimiter = ','
    )]
    pub trusted_proxy: Vec<String>,
    /// Prefix IPv6 clients are reduced to for ip:address.
    #[arg(help_heading = "Who the client is", long, env = "TOLLGATE_IPV6_PREFIX", default_value_t = 64, value_parser = clap::value_parser!(u8).range(1..=128))]
    pub ipv6_prefix: u8,
    /// Name of the header carrying the refusal reason.
    #[arg(help_heading = "Policy", long, env = "TOLLGATE_REASON_HEADER", default_value = crate::engine::headers::DEFAULT_REASON_HEADER)]
    pub reason_header: String,
    /// Log format.
    #[arg(
        help_heading = "Operators and logs",
        long,
        env = "TOLLGATE_LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    pub log_format: LogFormat,
    /// HMAC secret for HS256/384/512 tokens.
    #[arg(
        help_heading = "Who the client is",
        long,
        env = "TOLLGATE_JWT_SECRET",
        hide_env_values = true
    )]
    pub jwt_secret: Option<String>,
    /// PEM public key (RSA, EC or Ed25519) for RS*/PS*/ES*/EdDSA tokens (repeatable).
    #[arg(
        help_heading = "Who the client is",
        long = "jwt-public-key",
        env = "TOLLGATE_JWT_PUBLIC_KEY",
        value_delimiter = ','
    )]
    pub jwt_public_key: Vec<PathBuf>,
    /// JWKS file; keys chosen by `kid`, re-read with every policy reload.
    #[arg(help_heading = "Who the client is", long, env = "TOLLGATE_JWT_JWKS")]
    pub jwt_jwks: Option<PathBuf>,
    /// Use JWT claims WITHOUT checking signatures (only behind a layer that verifies them).
    #[arg(
        help_heading = "Who the client is",
        long,
        env = "TOLLGATE_JWT_UNVERIFIED"
    )]
    pub jwt_unverified: bool,
    /// Allowed algorithms (default: every algorithm of the configured keys' families).
    #[arg(
        help_heading = "Who the client is",
        long,
        env = "TOLLGATE_JWT_ALGORITHMS",
        value_delimiter = ','
    )]
    pub jwt_algorithms: Vec<String>,
    /// Clock-skew allowance for exp/nbf, in seconds.
    #[arg(
        help_heading = "Who the client is",
        long,
        env = "TOLLGATE_JWT_LEEWAY_SECS",
        default_value_t = 30
    )]
    pub jwt_leeway_secs: u64,
    /// Required `iss`.
    #[arg(help_heading = "Who the client is", long, env = "TOLLGATE_JWT_ISSUER")]
    pub jwt_issuer: Option<String>,
    /// Required `aud`.
    #[arg(
        help_heading = "Who the client is",
        long,
        env = "TOLLGATE_JWT_AUDIENCE"
    )]
    pub jwt_audience: Option<String>,
    /// Read the token from this header instead of `Authorization: Bearer`.
    #[arg(
        help_heading = "Who the client is",
        long,
        env = "TOLLGATE_JWT_HEADER",
        conflicts_with = "jwt_cookie"
    )]
    pub jwt_header: Option<String>,
    /// Read the token from this cookie instead of `Authorization: Bearer`.
    #[arg(help_heading = "Who the client is", long, env = "TOLLGATE_JWT_COOKIE")]
    pub jwt_cookie: Option<String>,
    /// Seconds between checks of the policy file for changes (0 = only SIGHUP).
    #[arg(
        help_heading = "Policy",
        long,
        env = "TOLLGATE_POLICY_POLL_SECS",
        default_value_t = 2
    )]
    pub policy_poll_secs: u64,
    /// Encoded slashes (`%2F`, `%5C`) in a request path: `decode` them for matching (the
    /// request is forwarded unchanged), or `reject` the request with 400.
    #[arg(
        help_heading = "Who the client is",
        long,
        env = "TOLLGATE_ENCODED_SLASHES",
        value_enum,
        default_value = "decode"
    )]
    pub encoded_slashes: EncodedSlashesArg,
    /// Total seconds a new connection has to send its first request's headers; slow or silent
    /// clients are cut off after it (later requests on a kept-alive connection get the
    /// keep-alive timeout instead).
    #[arg(
        help_heading = "Connections",
        long,
        env = "TOLLGATE_HEADER_TIMEOUT_SECS",
        default_value_t = 10
    )]
    pub header_timeout_secs: u64,
    /// Seconds a kept-alive connection has, after a response, to send its next request's headers.
    #[arg(
        help_heading = "Connections",
        long,
        env = "TOLLGATE_KEEPALIVE_TIMEOUT_SECS",
        default_value_t = 60
    )]
    pub keepalive_timeout_secs: u64,
    /// Seconds a response may wait for the client to take the next piece of it (nginx's
    /// `send_timeout`: between two successive writes, not for the whole response); a client
    /// that reads nothing for that long is cut off, giving back its upstream slot.
    #[arg(
        help_heading = "Connections",
        long,
        env = "TOLLGATE_SEND_TIMEOUT_SECS",
        default_value_t = 60
    )]
    pub send_timeout_secs: u64,
    /// Largest request body read before deciding a request under a `token_bucket_llm` rule (the
    /// proxy and the decision service): a larger one gets 413.
    #[arg(help_heading = "LLM token budgets", long, env = "TOLLGATE_MAX_BODY_BYTES", default_value_t = 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Seconds the decision service keeps an LLM reservation for `POST /v1/usage`; one not
    /// reported by then stays charged as reserved.
    #[arg(
        help_heading = "LLM token budgets",
        long,
        env = "TOLLGATE_RESERVATION_TTL_SECS",
        default_value_t = 600
    )]
    pub reservation_ttl_secs: u64,
    /// A secret shared by every gateway of a fleet on one shared --store (at least 32 bytes;
    /// best from the environment): decision-service LLM reservations then travel in tokens
    /// signed with it, and `POST /v1/usage` settles one on any gateway of the fleet, once.
    /// Without it, a reservation is held by the gateway that made it.
    #[arg(
        help_heading = "LLM token budgets",
        long,
        env = "TOLLGATE_RESERVATION_SECRET",
        hide_env_values = true
    )]
    pub reservation_secret: Option<String>,
    /// Most client connections the proxy holds at once; further ones get 503 and are closed.
    /// Default: what the open-file limit leaves after upstream connections, at most 50 000 (see the
    /// manual, "At the edge"). The admin listener has its own cap: this value, at most 4 096.
    #[arg(help_heading = "Connections", long, env = "TOLLGATE_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Most connections one client address holds open on the proxy listeners at once (nginx's
    /// `limit_conn`): further ones get 429 `connection_limit` and are closed. IPv6 clients count
    /// per /64 (--ipv6-prefix); --trusted-proxy peers are not counted. Off unless set.
    #[arg(
        help_heading = "Connections",
        long,
        env = "TOLLGATE_MAX_CONNECTIONS_PER_IP"
    )]
    pub max_connections_per_ip: Option<usize>,
    /// Largest request header block the proxy takes, in bytes (request line and every header
    /// line); a larger one gets 431 (Envoy: 60 KiB, nginx: 32 KiB). From 1 to 1048575.
    #[arg(
        help_heading = "Connections",
        long,
        env = "TOLLGATE_MAX_REQUEST_HEADER_BYTES",
        default_value_t = DEFAULT_MAX_HEADER_BYTES
    )]
    pub max_request_header_bytes: usize,
    /// Most header lines a request may carry on the proxy; more get 431 (Envoy's default: 100).
    /// From 1 to 256 (Pingora's parser refuses more with 400 before the gateway sees them).
    #[arg(
        help_heading = "Connections",
        long,
        env = "TOLLGATE_MAX_REQUEST_HEADERS",
        default_value_t = DEFAULT_MAX_HEADER_LINES
    )]
    pub max_request_headers: usize,
    /// A TLS listener next to --listen (which stays cleartext). Without it, --tls-cert/--tls-key
    /// make --listen itself serve HTTPS.
    #[arg(
        help_heading = "Listeners and upstreams",
        long,
        env = "TOLLGATE_LISTEN_TLS"
    )]
    pub listen_tls: Option<String>,
    /// PEM certificate chain for HTTPS (repeatable, paired in order with --tls-key; chosen by
    /// SNI, the first is the default). Reloaded on SIGHUP and when the files change.
    #[arg(
        help_heading = "Listeners and upstreams",
        long = "tls-cert",
        env = "TOLLGATE_TLS_CERT",
        value_delimiter = ','
    )]
    pub tls_cert: Vec<PathBuf>,
    /// PEM private key of the --tls-cert at the same position.
    #[arg(
        help_heading = "Listeners and upstreams",
        long = "tls-key",
        env = "TOLLGATE_TLS_KEY",
        value_delimiter = ','
    )]
    pub tls_key: Vec<PathBuf>,
    /// Load a bundle whose policies partly fail validation: the failing policies are left out
    /// (logged, counted in `tollgate_policies_skipped`, listed in `/readyz`), as Fairvisor's
    /// loader does. Off by default: one bad policy refuses the bundle.
    #[arg(help_heading = "Policy", long, env = "TOLLGATE_SKIP_INVALID_POLICIES")]
    pub skip_invalid_policies: bool,
    /// Accept HTTP/2 with prior knowledge (h2c) on the cleartext listener. On TLS, HTTP/2 is
    /// always offered by ALPN (h2, then http/1.1).
    #[arg(help_heading = "Listeners and upstreams", long, env = "TOLLGATE_H2C")]
    pub h2c: bool,
    /// One access-log line per proxied request on standard output: `off` (default), `text`
    /// (nginx combined plus key=value fields) or `json`. Turns on X-Request-Id handling.
    #[arg(
        help_heading = "Operators and logs",
        long,
        env = "TOLLGATE_ACCESS_LOG",
        value_enum,
        default_value = "off"
    )]
    pub access_log: AccessLogArg,
    /// Whose W3C trace context (traceparent, tracestate) a request continues when traces are
    /// on (OTEL_EXPORTER_OTLP_ENDPOINT set): `accept` (any client's, default), `trusted`
    /// (only --trusted-proxy peers'; others start a new trace) or `ignore` (always a new trace).
    #[arg(
        help_heading = "Operators and logs",
        long,
        env = "TOLLGATE_TRACE_CONTEXT",
        value_enum,
        default_value = "accept"
    )]
    pub trace_context: crate::telemetry::traces::TraceContextTrust,
    /// gRPC listener for Envoy: `envoy.service.ratelimit.v3.RateLimitService`,
    /// `envoy.service.auth.v3.Authorization` and `grpc.health.v1.Health` (h2c, or TLS with
    /// --grpc-tls-cert/--grpc-tls-key). Off unless set.
    #[arg(
        help_heading = "Listeners and upstreams",
        long,
        env = "TOLLGATE_GRPC_LISTEN"
    )]
    pub grpc_listen: Option<String>,
    /// PEM certificate chain for the gRPC listener (TLS); needs --grpc-tls-key.
    #[arg(
        help_heading = "Listeners and upstreams",
        long,
        env = "TOLLGATE_GRPC_TLS_CERT",
        requires = "grpc_tls_key"
    )]
    pub grpc_tls_cert: Option<PathBuf>,
    /// PEM private key for the gRPC listener.
    #[arg(
        help_heading = "Listeners and upstreams",
        long,
        env = "TOLLGATE_GRPC_TLS_KEY",
        requires = "grpc_tls_cert"
    )]
    pub grpc_tls_key: Option<PathBuf>,
    /// A shared store that does not answer during a gRPC call: `allow` (each rule's
    /// `on_store_error` decides, counted, as everywhere else) or `unavailable` (gRPC
    /// UNAVAILABLE, so Envoy's `failure_mode_deny` decides).
    #[arg(
        help_heading = "Listeners and upstreams",
        long,
        env = "TOLLGATE_GRPC_STORE_ERRORS",
        value_enum,
        default_value = "allow"
    )]
    pub grpc_store_errors: GrpcStoreErrors,
}

/// `--compat` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CompatArg {
    None,
    Fairvisor,
}

/// `--access-log` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AccessLogArg {
    Off,
    Text,
    Json,
}

/// `--grpc-store-errors` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GrpcStoreErrors {
    Allow,
    Unavailable,
}

/// `--encoded-slashes` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EncodedSlashesArg {
    Decode,
    Reject,
}

#[derive(Debug, Args)]
pub struct ValidateArgs {
    /// Bundle files.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// Report policies with errors as skipped instead of failing the bundle (as `run
    /// --skip-invalid-policies` would load it).
    #[arg(long)]
    pub skip_invalid_policies: bool,
    /// The state dir `run` will use, if any: without it (or a shared --store), rules whose
    /// state a restart resets are warned about.
    #[arg(long, env = "TOLLGATE_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// The store `run` will use (`memory` or a shared store's URL).
    #[arg(long, env = "TOLLGATE_STORE", default_value = "memory")]
    pub store: String,
}

#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// Policy bundle.
    #[arg(long)]
    pub policy: PathBuf,
    /// JSON-lines requests (`-` = standard input).
    #[arg(long, default_value = "-")]
    pub requests: PathBuf,
    /// Prefix IPv6 clients are reduced to.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u8).range(1..=128))]
    pub ipv6_prefix: u8,
    /// Wall-clock time of `t = 0` (RFC 3339), for kill-switch expiry. Fixed by default so a
    /// replay gives the same answer on any day.
    #[arg(long, default_value = "2026-01-01T00:00:00Z", value_parser = parse_start)]
    pub start: i64,
}

/// A `simulate --start` that is not a time it can start at.
#[derive(Debug, thiserror::Error)]
pub enum StartTimeError {
    #[error("{text:?}: {error} (expected e.g. 2026-01-01T00:00:00Z)")]
    NotRfc3339 {
        text: String,
        error: humantime::TimestampError,
    },
    #[error("{0:?} is before 1970")]
    Before1970(String),
}

fn parse_start(text: &str) -> Result<i64, StartTimeError> {
    humantime::parse_rfc3339_weak(text)
        .map_err(|error| StartTimeError::NotRfc3339 {
            text: text.to_string(),
            error,
        })?
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .map_err(|_| StartTimeError::Before1970(text.to_string()))
}

/// `--max-request-header-bytes`' default: the whole header block (request line included).
/// Envoy's default is 60 KiB, nginx's 32 KiB (and 8 KiB a line); a 16 KiB cookie passes.
pub const DEFAULT_MAX_HEADER_BYTES: usize = 64 * 1024;

/// `--max-request-headers`' default: header lines per request (Envoy's default count).
pub const DEFAULT_MAX_HEADER_LINES: usize = 100;

/// Exit codes.
pub const EXIT_OK: u8 = 0;
/// Invalid input (policy or requests).
pub const EXIT_INVALID: u8 = 1;
/// Usage or runtime failure.
pub const EXIT_FAILURE: u8 = 2;

/// `tollgate validate`: prints a verdict per file to `out` (errors to `err`); returns the exit code.
pub fn validate(args: &ValidateArgs, out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    let mut code = EXIT_OK;
    for file in &args.files {
        let gateway_file = std::fs::read(file)
            .ok()
            .and_then(|bytes| serde_json::from_slice::<serde_json::Value>(&bytes).ok())
            .is_some_and(|root| crate::config::routes::is_gateway_file(&root));
        if gateway_file {
            match crate::config::routes::load_file(file) {
                Ok(table) => {
                    let _ = writeln!(
                        out,
                        "{}: ok (gateway file: {} upstream groups, {} routes, default {})",
                        file.display(),
                        table.groups.len(),
                        table.route_count(),
                        table
                            .default
                            .and_then(|i| table.groups.get(i))
                            .map_or("none", |g| g.name.as_str())
                    );
                }
                Err(e) => {
                    let _ = writeln!(err, "{e}");
                    code = EXIT_INVALID;
                }
            }
            continue;
        }
        let options = crate::policy::CompileOptions {
            skip_invalid_policies: args.skip_invalid_policies,
            ..Default::default()
        };
        match crate::policy::load_current(file, options, crate::limits::clock::wall_unix_secs()) {
            Ok(bundle) => {
                let _ = writeln!(
                    out,
                    "{}: ok (bundle_version {}, {} policies, {} rules, {} kill switches, hash {})",
                    file.display(),
                    bundle.version,
                    bundle.policies.len(),
                    bundle.written_rule_count(),
                    bundle.kill_switches.len(),
                    bundle.hash
                );
                for warning in &bundle.warnings {
                    let _ = writeln!(out, "  warning: {warning}");
                }
                if bundle.enforces_nothing() {
                    let _ = writeln!(
                        out,
                        "  warning: no policy and no kill switch in force: `tollgate run` refuses this file unless --allow-empty-policy"
                    );
                }
                // `run`'s defaults: verified JWT claims, IPv6 clients keyed per /64.
                let trust = crate::policy::key_origin::KeyTrust::default();
                for warning in bundle.made_up_key_warnings(&trust) {
                    let _ = writeln!(out, "  warning: {warning}");
                }
                if args.state_dir.is_none() && args.store == "memory" {
                    if let Some(warning) = bundle.restart_warning() {
                        let _ = writeln!(out, "  warning: {warning}");
                    }
                }
                for skipped in &bundle.skipped {
                    let _ = writeln!(
                        out,
                        "  skipped: {} (id '{}'): {}",
                        skipped.path,
                        skipped.id,
                        skipped
                            .errors
                            .iter()
                            .map(ToString::to_string)
                            .collect::<Vec<_>>()
                            .join("; ")
                    );
                }
            }
            Err(e) => {
                let _ = writeln!(err, "{e}");
                code = EXIT_INVALID;
            }
        }
    }
    code
}

/// `tollgate import`: the bundle on `out`, notes and errors on `err`; returns the exit code.
pub fn import(command: &ImportCommand, out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    match command {
        ImportCommand::EnvoyRatelimit { file } => {
            match crate::policy::import::envoy_ratelimit_file(file) {
                Ok(imported) => {
                    let text = serde_json::to_string_pretty(&imported.bundle)
                        .unwrap_or_else(|_| "{}".to_string());
                    let _ = writeln!(out, "{text}");
                    for note in &imported.notes {
                        let _ = writeln!(err, "not mapped exactly: {note}");
                    }
                    EXIT_OK
                }
                Err(e) => {
                    let _ = writeln!(err, "{e}");
                    match e {
                        crate::policy::import::ImportError::Read { .. } => EXIT_FAILURE,
                        _ => EXIT_INVALID,
                    }
                }
            }
        }
    }
}

/// `tollgate simulate`; returns the exit code.
pub fn simulate(args: &SimulateArgs, out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    let bundle = match load_file(&args.policy) {
        Ok(b) => b,
        Err(e) => {
            let _ = writeln!(err, "{e}");
            return match e {
                PolicyError::Io { .. } => EXIT_FAILURE,
                _ => EXIT_INVALID,
            };
        }
    };
    let config = EngineConfig {
        ipv6_prefix: args.ipv6_prefix,
    };
    let result = if args.requests.as_os_str() == "-" {
        crate::engine::simulate::replay(bundle, config, args.start, std::io::stdin().lock(), out)
    } else {
        match std::fs::File::open(&args.requests) {
            Ok(f) => {
                crate::engine::simulate::replay(bundle, config, args.start, BufReader::new(f), out)
            }
            Err(e) => {
                let _ = writeln!(err, "{}: cannot read: {e}", args.requests.display());
                return EXIT_FAILURE;
            }
        }
    };
    match result {
        Ok(0) => EXIT_OK,
        Ok(bad) => {
            let _ = writeln!(err, "{bad} request line(s) could not be replayed (see the \"error\" objects in the output)");
            EXIT_INVALID
        }
        Err(e) => {
            let _ = writeln!(err, "{e}");
            EXIT_FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every example `tollgate help <command>` shows parses as written, and the files it names
    /// from this repository exist.
    #[test]
    fn the_help_examples_parse() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut seen = 0;
        for examples in [
            RUN_EXAMPLES,
            VALIDATE_EXAMPLES,
            SIMULATE_EXAMPLES,
            IMPORT_EXAMPLES,
            PUBLISH_EXAMPLES,
            PROMOTE_EXAMPLES,
            ROLLBACK_EXAMPLES,
            REFRESH_EXAMPLES,
            FLEET_EXAMPLES,
            REPAIR_EXAMPLES,
        ] {
            for line in examples.lines().map(str::trim) {
                let Some(args) = line.strip_prefix("tollgate ") else {
                    continue;
                };
                seen += 1;
                let argv: Vec<&str> = std::iter::once("tollgate")
                    .chain(args.split_whitespace())
                    .collect();
                if let Err(e) = Cli::try_parse_from(&argv) {
                    panic!("{line}: {e}");
                }
                for word in args.split_whitespace() {
                    if word.starts_with("policies/") || word.starts_with("examples/") {
                        assert!(root.join(word).exists(), "{line}: no {word}");
                    }
                }
            }
        }
        assert_eq!(seen, 11 + 8 + 3);
    }
}
