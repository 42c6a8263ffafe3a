//! What ships under `deploy/` (and the Dockerfile) works with this binary: the Dockerfile's
//! build stage copies every file the build reads; the Kubernetes
//! manifests and the image name only flags, environment variables, ports and probe paths
//! `tollgate run` has, and the Deployment's container, started as written (its volumes as
//! directories, its ports on loopback), answers its probes, proxies and reads its admin token;
//! the policy ConfigMap is the shipped policy, and a ConfigMap update (the kubelet's symlink
//! swap) reloads it; the systemd unit passes `systemd-analyze verify` with no warning and rates
//! 2.0 or below in `systemd-analyze security`, and its `ExecStart=` and
//! `ExecReload=` lines, run with the same arguments as a user of their own, start the gateway and
//! upgrade it with no failed request, and refuse a reload whose policy is invalid.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{CommandFactory, Parser};
use serde::Deserialize;
use serde_yaml_ng::Value;
use support::{free_port, request, try_request, Upstream};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn yaml_docs(rel: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(&read(rel))
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("{rel}: {e}")))
        .filter(|doc| !doc.is_null())
        .collect()
}

fn the_kind<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"].as_str() == Some(kind) && d["metadata"]["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn text(v: &Value) -> &str {
    v.as_str().unwrap_or_else(|| panic!("not a string: {v:?}"))
}

/// `tollgate run`'s arguments by environment variable: (long flag, takes a value).
fn run_env() -> BTreeMap<String, (String, bool)> {
    let cli = tollgate::config::cli::Cli::command();
    let run = cli.find_subcommand("run").expect("tollgate run");
    run.get_arguments()
        .filter_map(|a| {
            Some((
                a.get_env()?.to_str()?.to_string(),
                (a.get_long()?.to_string(), a.get_action().takes_values()),
            ))
        })
        .collect()
}

/// Parses `tollgate run ARGS` with the environment given as the flags it stands for: an unknown
/// variable or flag, or a value that does not parse, is an error.
fn parse_run(args: &[String], env: &[(String, String)]) -> Result<(), String> {
    let by_env = run_env();
    let mut argv = vec!["tollgate".to_string(), "run".to_string()];
    argv.extend(args.iter().cloned());
    for (name, value) in env {
        if !name.starts_with("TOLLGATE_") {
            continue;
        }
        let (long, takes_value) = by_env
            .get(name)
            .ok_or_else(|| format!("no flag of `tollgate run` reads {name}"))?;
        argv.push(format!("--{long}"));
        if *takes_value {
            argv.push(value.clone());
        }
    }
    tollgate::config::cli::Cli::try_parse_from(&argv)
        .map(|_| ())
        .map_err(|e| format!("{argv:?}: {e}"))
}

fn container_env(container: &Value) -> Vec<(String, String)> {
    container["env"]
        .as_sequence()
        .map(|env| {
            env.iter()
                .map(|e| (text(&e["name"]).to_string(), text(&e["value"]).to_string()))
                .collect()
        })
        .unwrap_or_default()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_sequence()
        .map(|s| s.iter().map(|w| text(w).to_string()).collect())
        .unwrap_or_default()
}

fn deployment_container(docs: &[Value]) -> &Value {
    &the_kind(docs, "Deployment", "tollgate")["spec"]["template"]["spec"]["containers"][0]
}

/// The port a named container port stands for.
fn container_port(container: &Value, name: &str) -> u64 {
    container["ports"]
        .as_sequence()
        .and_then(|ports| ports.iter().find(|p| p["name"].as_str() == Some(name)))
        .and_then(|p| p["containerPort"].as_u64())
        .unwrap_or_else(|| panic!("no container port named {name}"))
}

#[test]
fn the_kubernetes_manifests_name_what_the_binary_has() {
    let base = yaml_docs("deploy/kubernetes/deployment.yaml");
    let deployment = the_kind(&base, "Deployment", "tollgate");
    let pod = &deployment["spec"]["template"]["spec"];
    let container = deployment_container(&base);
    let args = strings(&container["args"]);
    let env = container_env(container);
    parse_run(&args, &env).unwrap();

    // The listeners the environment names are the container's ports.
    let env_map: BTreeMap<_, _> = env.iter().cloned().collect();
    for (var, port) in [
        ("TOLLGATE_LISTEN", "proxy"),
        ("TOLLGATE_ADMIN_LISTEN", "admin"),
    ] {
        let addr: SocketAddr = env_map[var].parse().expect(var);
        assert_eq!(
            u64::from(addr.port()),
            container_port(container, port),
            "{var}"
        );
    }
    // Probes on the admin port: readiness /readyz, liveness /livez.
    for (probe, path) in [("readinessProbe", "/readyz"), ("livenessProbe", "/livez")] {
        assert_eq!(container[probe]["httpGet"]["path"].as_str(), Some(path));
        assert_eq!(container[probe]["httpGet"]["port"].as_str(), Some("admin"));
    }
    // Locked down: non-root, read-only root, no capability, no privilege escalation.
    let security = &container["securityContext"];
    assert_eq!(security["readOnlyRootFilesystem"].as_bool(), Some(true));
    assert_eq!(security["allowPrivilegeEscalation"].as_bool(), Some(false));
    assert_eq!(strings(&security["capabilities"]["drop"]), ["ALL"]);
    assert_eq!(pod["securityContext"]["runAsNonRoot"].as_bool(), Some(true));
    assert_ne!(pod["securityContext"]["runAsUser"].as_u64(), Some(0));
    // The preStop pause and tollgate's exit after SIGTERM (1 s for requests in flight, 11 s at
    // most in all) fit in the grace period.
    let pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        .as_u64()
        .expect("preStop sleep");
    let grace = pod["terminationGracePeriodSeconds"]
        .as_u64()
        .expect("grace");
    assert!(
        pre_stop + 11 < grace,
        "preStop {pre_stop} s + 11 s drain >= {grace} s"
    );
    assert!(container["resources"]["requests"]["memory"]
        .as_str()
        .is_some());
    assert!(container["resources"]["limits"]["memory"]
        .as_str()
        .is_some());

    // Services: internal (ClusterIP), selecting the pods, targeting ports the container has.
    let labels = &deployment["spec"]["template"]["metadata"]["labels"];
    let services = yaml_docs("deploy/kubernetes/services.yaml");
    let mut names = BTreeSet::new();
    for service in &services {
        assert_eq!(service["spec"]["type"].as_str(), Some("ClusterIP"));
        for (key, value) in service["spec"]["selector"].as_mapping().expect("selector") {
            assert_eq!(&labels[text(key)], value, "selector {key:?}");
        }
        for port in service["spec"]["ports"].as_sequence().expect("ports") {
            container_port(container, text(&port["targetPort"]));
            names.insert(text(&port["targetPort"]).to_string());
        }
    }
    assert_eq!(
        names,
        BTreeSet::from(["admin".to_string(), "proxy".to_string()])
    );
    let pdb = &yaml_docs("deploy/kubernetes/pdb.yaml")[0];
    for (key, value) in pdb["spec"]["selector"]["matchLabels"]
        .as_mapping()
        .expect("pdb selector")
    {
        assert_eq!(&labels[text(key)], value);
    }

    // The redis-fleet overlay's additions parse too, and name the Redis Service it ships.
    let patch = yaml_docs("deploy/kubernetes/redis-fleet/store.patch.yaml");
    let mut fleet_env = env.clone();
    for op in patch[0].as_sequence().expect("ops") {
        if text(&op["path"]).ends_with("/env/-") {
            fleet_env.push((
                text(&op["value"]["name"]).to_string(),
                text(&op["value"]["value"]).to_string(),
            ));
        }
    }
    parse_run(&args, &fleet_env).unwrap();
    let store = fleet_env
        .iter()
        .find(|(k, _)| k == "TOLLGATE_STORE")
        .map(|(_, v)| v.clone())
        .expect("TOLLGATE_STORE in the overlay");
    let redis = yaml_docs("deploy/kubernetes/redis-fleet/redis.yaml");
    let redis_service = the_kind(&redis, "Service", "tollgate-redis");
    let port = redis_service["spec"]["ports"][0]["port"].as_u64().unwrap();
    assert_eq!(store, format!("redis://tollgate-redis:{port}"));

    // The checks can fail.
    assert!(parse_run(&[], &[("TOLLGATE_NO_SUCH".into(), "x".into())]).is_err());
    assert!(parse_run(&["--no-such".into()], &[]).is_err());
    assert!(parse_run(&[], &[("TOLLGATE_THREADS".into(), "many".into())]).is_err());
}

/// The Dockerfile's stages by name: (the image it starts from, its instructions, comments and
/// blank lines left out, continuation lines joined).
fn dockerfile_stages() -> BTreeMap<String, (String, Vec<String>)> {
    let mut stages = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in read("Dockerfile").replace("\\\n", " ").lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(rest) = line.strip_prefix("FROM ") {
            let (from, name) = rest.split_once(" AS ").expect("FROM x AS name");
            stages.insert(name.to_string(), (from.to_string(), Vec::new()));
            current = Some(name.to_string());
        } else if let Some(name) = &current {
            stages
                .get_mut(name)
                .expect("stage")
                .1
                .push(line.split_whitespace().collect::<Vec<_>>().join(" "));
        }
    }
    stages
}

/// The image's ENV, ENTRYPOINT and CMD parse as `tollgate run` arguments, and the target
/// scripts/image.sh builds (a binary from another image) is the default target but for where
/// the binary comes from.
#[test]
fn the_image_names_what_the_binary_has() {
    let stages = dockerfile_stages();
    let (_, config) = &stages["runtime-config"];
    let mut env = Vec::new();
    let mut cmd = Vec::new();
    for line in config {
        if let Some(rest) = line.strip_prefix("ENV ") {
            for pair in rest.split_whitespace() {
                let (k, v) = pair.split_once('=').expect("ENV k=v");
                env.push((k.to_string(), v.to_string()));
            }
        }
        if let Some(rest) = line.strip_prefix("ENTRYPOINT ") {
            let words: Vec<String> = serde_json::from_str(rest).expect("ENTRYPOINT as JSON");
            assert_eq!(words, ["/usr/local/bin/tollgate", "run"]);
        }
        if let Some(rest) = line.strip_prefix("CMD ") {
            cmd = serde_json::from_str(rest).expect("CMD as JSON");
        }
    }
    assert!(env.iter().any(|(k, _)| k == "TOLLGATE_POLICY"));
    assert_eq!(cmd, ["--state-dir", "/var/lib/tollgate"]);
    parse_run(&cmd, &env).unwrap();
    assert!(config.contains(&"USER 65532:65532".to_string()));

    let (default_from, default) = &stages["runtime"];
    let (prebuilt_from, prebuilt) = &stages["runtime-prebuilt"];
    assert_eq!(
        (default_from.as_str(), prebuilt_from.as_str()),
        ("runtime-config", "runtime-config")
    );
    let as_default: Vec<String> = prebuilt
        .iter()
        .map(|l| l.replace("--from=prebuilt", "--from=build"))
        .collect();
    assert_eq!(&as_default, default);
    assert!(default.contains(&"VOLUME [\"/var/lib/tollgate\"]".to_string()));
    // The default target is the last stage (what `docker build .` makes).
    let last = read("Dockerfile")
        .lines()
        .rfind(|l| l.starts_with("FROM "))
        .map(str::to_string);
    assert_eq!(last.as_deref(), Some("FROM runtime-config AS runtime"));
}

/// The build stage (`docker build .`) copies everything the shipped build reads: cargo loads the
/// manifest from exactly what its `COPY` lines bring (the carried Pingora crates under `vendor/`
/// included) and finds both targets `scripts/shipped-build.sh` builds, the script and the
/// committed profile are there, the stage runs the script and ships its binary, and its
/// compiler is the one the profile was written by.
#[test]
fn the_build_stage_copies_what_the_shipped_build_reads() {
    let stages = dockerfile_stages();
    let (from, build) = &stages["build"];
    assert!(build.contains(&"WORKDIR /src".to_string()), "{build:?}");
    let ignored: Vec<String> = read(".dockerignore")
        .lines()
        .map(|l| l.trim().trim_end_matches('/').to_string())
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let context = tempfile::tempdir().unwrap();
    for line in build {
        let Some(rest) = line.strip_prefix("COPY ") else {
            continue;
        };
        let words: Vec<&str> = rest.split_whitespace().collect();
        let (dest, sources) = words.split_last().expect("COPY src... dest");
        assert!(
            !dest.starts_with('/'),
            "{line}: a destination under WORKDIR"
        );
        for source in sources {
            assert!(
                !ignored.iter().any(|i| source.starts_with(i.as_str())),
                "{line}: .dockerignore leaves {source} out of the context"
            );
            let from = root().join(source);
            // Docker's rules: into a destination ending in `/` a file goes by its own name and
            // a directory's contents go; otherwise the source becomes the destination.
            let (copy_from, to) = match (dest.ends_with('/'), from.is_dir()) {
                (true, true) => {
                    let to = context.path().join(dest);
                    std::fs::create_dir_all(&to).unwrap();
                    (from.join("."), to)
                }
                (true, false) => (
                    from.clone(),
                    context.path().join(dest).join(from.file_name().unwrap()),
                ),
                (false, _) => (from.clone(), context.path().join(dest)),
            };
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            let copied = Command::new("cp")
                .arg("-r")
                .arg(&copy_from)
                .arg(&to)
                .status()
                .unwrap();
            assert!(copied.success(), "{line}: cp {source}");
        }
    }
    // Only the host's packages: a build fetches no other platform's, so a cache filled by
    // builds alone has them (and `--offline` must not need more).
    let rustc_vv = Command::new("rustc").arg("-vV").output().unwrap();
    let rustc_vv = String::from_utf8(rustc_vv.stdout).unwrap();
    let host = rustc_vv
        .lines()
        .find_map(|l| l.strip_prefix("host: "))
        .expect("rustc -vV names its host");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let out = Command::new(cargo)
        .args(["metadata", "--locked", "--offline", "--format-version", "1"])
        .args(["--filter-platform", host])
        .arg("--manifest-path")
        .arg(context.path().join("Cargo.toml"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cargo metadata on the build stage's files: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let package = metadata["packages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "tollgate")
        .expect("the tollgate package");
    let targets: BTreeSet<(String, String)> = package["targets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["kind"][0].as_str().unwrap().to_string(),
                t["name"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    for wanted in [("bin", "tollgate"), ("example", "bare_proxy")] {
        let wanted = (wanted.0.to_string(), wanted.1.to_string());
        assert!(targets.contains(&wanted), "{wanted:?} in {targets:?}");
    }
    // The carried crates resolve from the copied vendor/, not from crates.io.
    let vendored: BTreeSet<&str> = metadata["packages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["source"].is_null())
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        vendored,
        BTreeSet::from(["pingora-core", "pingora-http", "tollgate"])
    );
    for read_by_the_script in [
        "scripts/shipped-build.sh",
        "pgo/profile.profdata.xz",
        "pgo/rustc-version",
    ] {
        assert!(
            context.path().join(read_by_the_script).is_file(),
            "{read_by_the_script} is not in the build stage"
        );
    }
    let run = build
        .iter()
        .find(|l| l.starts_with("RUN bash scripts/shipped-build.sh"))
        .expect("the stage runs scripts/shipped-build.sh");
    assert!(
        run.contains("strip -o /out/tollgate target/shipped/release/tollgate"),
        "{run}"
    );
    // `rustc 1.95.0 (59807616e 2026-04-14)` -> `rust:1.95.0-bookworm`.
    let wrote = read("pgo/rustc-version");
    let version = wrote
        .split_whitespace()
        .nth(1)
        .expect("rustc VERSION (...)");
    assert_eq!(from, &format!("rust:{version}-bookworm"));
}

/// The ConfigMap carries the shipped policy (`policies/axum-per-ip.json`), the one the image
/// ships and the manual's "what you should see" is about.
#[test]
fn the_policy_configmap_is_the_shipped_policy() {
    let docs = yaml_docs("deploy/kubernetes/policy.yaml");
    let configmap = the_kind(&docs, "ConfigMap", "tollgate-policy");
    let in_map: serde_json::Value =
        serde_json::from_str(text(&configmap["data"]["policy.json"])).expect("policy JSON");
    let shipped: serde_json::Value =
        serde_json::from_str(&read("policies/axum-per-ip.json")).expect("shipped policy");
    assert_eq!(in_map, shipped);
}

/// A kubelet volume of a ConfigMap: `KEY -> ..data/KEY`, `..data -> ..<timestamp>`; an update
/// writes a new timestamped directory and renames a new `..data` link over the old one.
struct ConfigMapVolume {
    dir: PathBuf,
    generation: usize,
}

impl ConfigMapVolume {
    fn new(dir: &Path, policy: &str) -> ConfigMapVolume {
        std::fs::create_dir_all(dir).expect("volume dir");
        let mut volume = ConfigMapVolume {
            dir: dir.to_path_buf(),
            generation: 0,
        };
        volume.update(policy);
        std::os::unix::fs::symlink("..data/policy.json", dir.join("policy.json")).expect("link");
        volume
    }

    fn update(&mut self, policy: &str) {
        self.generation += 1;
        let name = format!("..2026_11_26_08_00_00.{:09}", self.generation);
        std::fs::create_dir(self.dir.join(&name)).expect("timestamped dir");
        std::fs::write(self.dir.join(&name).join("policy.json"), policy).expect("write");
        let tmp = self.dir.join("..data_tmp");
        std::os::unix::fs::symlink(&name, &tmp).expect("..data_tmp");
        let old = std::fs::read_link(self.dir.join("..data")).ok();
        std::fs::rename(&tmp, self.dir.join("..data")).expect("swap ..data");
        if let Some(old) = old {
            std::fs::remove_dir_all(self.dir.join(old)).expect("remove the old generation");
        }
    }
}

fn one_rule(burst: u32) -> String {
    format!(
        r#"{{"rules": [{{"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
            "algorithm_config": {{"tokens_per_second": 0.001, "burst": {burst}}}}}]}}"#
    )
}

/// `n` decisions for one client address, their status codes.
fn decisions(admin: SocketAddr, client: &str, n: usize) -> Vec<u16> {
    (0..n)
        .map(|_| {
            request(
                admin,
                "POST",
                "/v1/decision",
                &[("X-Forwarded-For", client)],
            )
            .status
        })
        .collect()
}

fn readyz(admin: SocketAddr) -> serde_json::Value {
    let response = request(admin, "GET", "/readyz", &[]);
    assert_eq!(response.status, 200, "{}", response.body);
    serde_json::from_str(&response.body).expect("readyz JSON")
}

fn wait_until(limit: Duration, what: &str, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Kills what a test started if it panics before stopping it.
struct Reaper(Vec<u32>);

impl Drop for Reaper {
    fn drop(&mut self) {
        for pid in &self.0 {
            // SAFETY: kill(2) has no memory-safety preconditions; the pid is one we started.
            unsafe {
                libc::kill(*pid as i32, libc::SIGKILL);
            }
        }
    }
}

#[test]
fn a_configmap_update_through_the_kubelets_symlink_swap_reloads_the_policy() {
    let tmp = tempfile::tempdir().expect("tmp");
    let mut volume = ConfigMapVolume::new(&tmp.path().join("policy"), &one_rule(1));
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let listen = format!("127.0.0.1:{}", free_port());
    let log = std::fs::File::create(tmp.path().join("gateway.log")).expect("log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["run", "--policy-poll-secs", "1", "--threads", "1"])
        .env("TOLLGATE_POLICY", tmp.path().join("policy/policy.json"))
        .env("TOLLGATE_LISTEN", &listen)
        .env("TOLLGATE_ADMIN_LISTEN", admin.to_string())
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .spawn()
        .expect("spawn");
    let _reaper = Reaper(vec![child.id()]);
    wait_until(Duration::from_secs(20), "/livez", || {
        try_request(admin, "GET", "/livez", &[]).is_ok_and(|r| r.status == 200)
    });
    let before = readyz(admin)["policy_hash"].clone();
    assert_eq!(decisions(admin, "203.0.113.1", 2), [200, 429]);

    volume.update(&one_rule(3));
    // The bundle is put in force before its "policy loaded" line: wait for the line.
    let log_path = tmp.path().join("gateway.log");
    wait_until(Duration::from_secs(15), "the reload", || {
        std::fs::read_to_string(&log_path)
            .is_ok_and(|log| log.matches("policy loaded").count() >= 2)
    });
    assert_ne!(readyz(admin)["policy_hash"], before);
    assert_eq!(decisions(admin, "203.0.113.2", 4), [200, 200, 200, 429]);
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert_eq!(log.matches("policy loaded").count(), 2, "{log}");

    // SAFETY: kill(2) on our own child.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    assert!(child.wait().expect("wait").success());
}

/// The Deployment's container started as the kubelet would (its args and env; its volumes as
/// directories with the ConfigMap's and a Secret's files; 0.0.0.0 ports moved to free loopback
/// ports): the probes answer 200, the proxy forwards, the admin token from the Secret's file
/// opens the operator endpoints.
#[test]
fn the_deployments_container_serves_its_probes_as_written() {
    let base = yaml_docs("deploy/kubernetes/deployment.yaml");
    let policy_docs = yaml_docs("deploy/kubernetes/policy.yaml");
    let deployment = the_kind(&base, "Deployment", "tollgate");
    let container = deployment_container(&base);
    let tmp = tempfile::tempdir().expect("tmp");
    let token = "k8s-secret-token-0123456789abcdef";

    // Volumes: the ConfigMap's keys and the Secret's `token`, at their mount paths under tmp.
    let mut mounts = Vec::new();
    for mount in container["volumeMounts"].as_sequence().expect("mounts") {
        let name = text(&mount["name"]);
        let volume = deployment["spec"]["template"]["spec"]["volumes"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|v| v["name"].as_str() == Some(name))
            .expect("volume");
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        if let Some(configmap) = volume["configMap"]["name"].as_str() {
            let map = the_kind(&policy_docs, "ConfigMap", configmap);
            for (key, value) in map["data"].as_mapping().unwrap() {
                std::fs::write(dir.join(text(key)), text(value)).unwrap();
            }
        } else if volume["secret"]["secretName"].as_str().is_some() {
            std::fs::write(dir.join("token"), token).unwrap();
        } else {
            panic!("volume {name}: neither a ConfigMap nor a Secret");
        }
        mounts.push((text(&mount["mountPath"]).to_string(), dir));
    }
    let mut ports = BTreeMap::new();
    let local = |value: &str, ports: &mut BTreeMap<u16, u16>| -> String {
        if let Some(port) = value.strip_prefix("0.0.0.0:") {
            let port: u16 = port.parse().unwrap();
            let free = *ports.entry(port).or_insert_with(free_port);
            return format!("127.0.0.1:{free}");
        }
        for (path, dir) in &mounts {
            if let Some(rest) = value.strip_prefix(path.as_str()) {
                return format!("{}{rest}", dir.display());
            }
        }
        value.to_string()
    };
    let upstream = Upstream::start();
    let mut args = strings(&container["args"]);
    let at = args
        .iter()
        .position(|a| a == "--upstream")
        .expect("--upstream");
    args[at + 1] = upstream.addr.to_string();
    let env: Vec<(String, String)> = container_env(container)
        .into_iter()
        .map(|(k, v)| {
            let v = local(&v, &mut ports);
            (k, v)
        })
        .collect();
    let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("run")
        .args(&args)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::from(
            std::fs::File::create(tmp.path().join("gateway.log")).unwrap(),
        ))
        .spawn()
        .expect("spawn");
    let _reaper = Reaper(vec![child.id()]);
    let on = |name: &str| -> SocketAddr {
        let port = u16::try_from(container_port(container, name)).unwrap();
        format!("127.0.0.1:{}", ports[&port]).parse().unwrap()
    };
    wait_until(Duration::from_secs(20), "the liveness probe", || {
        let path = text(&container["livenessProbe"]["httpGet"]["path"]);
        try_request(on("admin"), "GET", path, &[]).is_ok_and(|r| r.status == 200)
    });
    let readiness = text(&container["readinessProbe"]["httpGet"]["path"]);
    assert_eq!(request(on("admin"), "GET", readiness, &[]).status, 200);
    wait_until(Duration::from_secs(20), "the proxy listener", || {
        std::net::TcpStream::connect(on("proxy")).is_ok()
    });
    let proxied = request(on("proxy"), "GET", "/orders", &[]);
    assert_eq!(
        (proxied.status, proxied.header("X-Upstream")),
        (200, Some("yes"))
    );
    let bearer = format!("Bearer {token}");
    assert_eq!(
        request(on("admin"), "GET", "/v1/top", &[("Authorization", &bearer)]).status,
        200
    );
    assert_eq!(request(on("admin"), "GET", "/v1/top", &[]).status, 401);
    // SAFETY: kill(2) on our own child.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    assert!(child.wait().expect("wait").success());
}

/// The unit file's `[Service]` settings, continuation lines joined as systemd joins them.
fn unit_settings() -> Vec<(String, String)> {
    read("deploy/systemd/tollgate.service")
        .replace("\\\n", " ")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with('['))
        .map(|l| {
            let (k, v) = l.split_once('=').expect("key=value");
            (k.to_string(), v.to_string())
        })
        .collect()
}

fn unit_value(settings: &[(String, String)], key: &str) -> String {
    settings
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| panic!("no {key}= in the unit"))
}

#[test]
fn the_systemd_unit_is_hardened_and_verifies() {
    let settings = unit_settings();
    for (key, value) in [
        ("User", "tollgate"),
        ("StateDirectory", "tollgate"),
        ("StateDirectoryMode", "0700"),
        ("ProtectSystem", "strict"),
        ("NoNewPrivileges", "yes"),
        ("AmbientCapabilities", "CAP_NET_BIND_SERVICE"),
        ("CapabilityBoundingSet", "CAP_NET_BIND_SERVICE"),
        ("ExitType", "cgroup"),
    ] {
        assert_eq!(unit_value(&settings, key), value, "{key}=");
    }
    // --state-dir is the StateDirectory= systemd makes (owned by the user, mode 0700), and the
    // flags the unit sets exist.
    let env: Vec<(String, String)> = settings
        .iter()
        .filter(|(k, _)| k == "Environment")
        .map(|(_, v)| {
            let (k, v) = v.split_once('=').expect("Environment=K=V");
            (k.to_string(), v.to_string())
        })
        .collect();
    assert!(env.contains(&("TOLLGATE_STATE_DIR".into(), "/var/lib/tollgate".into())));
    parse_run(&[], &env).unwrap();
    let start = support::shell_words(&unit_value(&settings, "ExecStart"));
    assert_eq!(start, ["/usr/local/bin/tollgate", "run"]);

    // systemd-analyze verify: exit 0 and not one warning (it warns but exits 0 on an unknown
    // key or a bad value), with the binary's path made real.
    let analyze = Command::new("systemd-analyze").arg("--version").output();
    assert!(
        analyze.is_ok_and(|o| o.status.success()),
        "systemd-analyze is not installed (bash scripts/install-deps.sh installs it)"
    );
    let verify = |unit: &str| {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("tollgate.service");
        std::fs::write(
            &path,
            unit.replace("/usr/local/bin/tollgate", env!("CARGO_BIN_EXE_tollgate")),
        )
        .unwrap();
        let out = Command::new("systemd-analyze")
            .arg("verify")
            .arg(&path)
            .output()
            .expect("systemd-analyze verify");
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), said)
    };
    let unit = read("deploy/systemd/tollgate.service");
    let (ok, said) = verify(&unit);
    assert!(
        ok && said.trim().is_empty(),
        "systemd-analyze verify:\n{said}"
    );
    // The check can fail.
    let (_, said) = verify(&unit.replace("ProtectSystem=strict", "ProtectSystm=strict"));
    assert!(said.contains("Unknown key"), "{said}");

    // systemd's own rating of the sandbox: exposure 2.0 or below ("OK"); the same unit without
    // its main restrictions rates above.
    let exposure_ok = |unit: &str| {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("tollgate.service");
        std::fs::write(&path, unit).unwrap();
        Command::new("systemd-analyze")
            .args(["security", "--offline=yes", "--threshold=20"])
            .arg(&path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("systemd-analyze security")
            .success()
    };
    assert!(
        exposure_ok(&unit),
        "systemd-analyze security rates the unit above 2.0"
    );
    let weakened: String = unit
        .lines()
        .filter(|l| {
            ![
                "NoNewPrivileges=",
                "ProtectSystem=",
                "CapabilityBoundingSet=",
                "SystemCallFilter=",
            ]
            .iter()
            .any(|k| l.starts_with(k))
        })
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(!exposure_ok(&weakened));
}

/// Reaps orphans: the process an `ExecReload=` starts outlives the shell that started it, as
/// it outlives systemd's control process; reparented to this test process, its exit status can
/// be read.
fn become_subreaper() {
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) only changes who reaps orphaned descendants.
    let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    assert_eq!(rc, 0, "PR_SET_CHILD_SUBREAPER");
}

fn wait_pid(pid: i32, limit: Duration) -> i32 {
    let start = Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: waitpid(2) on a descendant this process reaps, with a valid status pointer.
        let rc = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if rc == pid {
            assert!(libc::WIFEXITED(status), "pid {pid} was killed: {status}");
            return libc::WEXITSTATUS(status);
        }
        assert!(
            start.elapsed() < limit,
            "pid {pid} did not exit within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_systemd_units_start_and_reload_lines_start_and_upgrade_the_gateway() {
    become_subreaper();
    let settings = unit_settings();
    let tmp = tempfile::tempdir().expect("tmp");
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    // What systemd would make: StateDirectory= owned by the service's user, mode 0700. The
    // service's user here is nobody (65534), switched to with setpriv as User=/Group= would.
    let state = tmp.path().join("state");
    std::fs::create_dir(&state).unwrap();
    std::os::unix::fs::chown(&state, Some(65534), Some(65534)).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).unwrap();
    let policy = tmp.path().join("policy.json");
    std::fs::write(&policy, one_rule(3)).unwrap();
    let substitute = |word: &str| {
        word.replace("/usr/local/bin/tollgate", env!("CARGO_BIN_EXE_tollgate"))
            .replace("/var/lib/tollgate", state.to_str().unwrap())
            .replace("/etc/tollgate/policy.json", policy.to_str().unwrap())
    };
    // Environment= lines, then what an EnvironmentFile= would add: the listeners and upstream.
    let upstream = Upstream::start();
    let proxy: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let mut env: Vec<(String, String)> = settings
        .iter()
        .filter(|(k, _)| k == "Environment")
        .map(|(_, v)| {
            let (k, v) = v.split_once('=').expect("Environment=K=V");
            (k.to_string(), substitute(v))
        })
        .collect();
    env.extend([
        ("TOLLGATE_LISTEN".to_string(), proxy.to_string()),
        ("TOLLGATE_ADMIN_LISTEN".to_string(), admin.to_string()),
        ("TOLLGATE_UPSTREAM".to_string(), upstream.addr.to_string()),
        ("TOLLGATE_THREADS".to_string(), "1".to_string()),
        (
            "PATH".to_string(),
            "/usr/sbin:/usr/bin:/sbin:/bin".to_string(),
        ),
    ]);
    let log_path = tmp.path().join("journal.log");
    let command = |key: &str| {
        let words: Vec<String> = support::shell_words(&unit_value(&settings, key))
            .iter()
            .map(|w| substitute(w))
            .collect();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .unwrap();
        let mut cmd = Command::new("setpriv");
        cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .args(&words)
            .env_clear()
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log));
        cmd
    };
    let journal = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let owner = || -> Option<i32> {
        std::fs::read_to_string(state.join("owner.lock"))
            .ok()?
            .trim()
            .parse()
            .ok()
    };

    let mut main: Child = command("ExecStart").spawn().expect("ExecStart");
    let main_pid = main.id() as i32;
    let mut reaper = Reaper(vec![main.id()]);
    wait_until(Duration::from_secs(20), "ExecStart's gateway", || {
        try_request(admin, "GET", "/readyz", &[]).is_ok_and(|r| r.status == 200)
    });
    assert_eq!(owner(), Some(main_pid), "{}", journal());
    assert_eq!(decisions(admin, "203.0.113.7", 4), [200, 200, 200, 429]);

    // A client that never stops, one new connection per request, through the reload.
    let stop = Arc::new(AtomicBool::new(false));
    let (served, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let client = {
        let (stop, served, failed) = (stop.clone(), served.clone(), failed.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                match try_request(proxy, "GET", "/", &[("X-Forwarded-For", "198.51.100.1")]) {
                    Ok(r) if r.status == 200 || r.status == 429 => {
                        served.fetch_add(1, Ordering::SeqCst)
                    }
                    _ => failed.fetch_add(1, Ordering::SeqCst),
                };
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };

    let status = command("ExecReload").status().expect("ExecReload");
    assert!(
        status.success(),
        "ExecReload failed: {status}\n{}",
        journal()
    );
    let new_pid = owner().expect("owner.lock after the reload");
    reaper.0.push(new_pid as u32);
    assert_ne!(new_pid, main_pid);
    assert!(
        main.wait().expect("wait").success(),
        "the old gateway did not exit 0"
    );
    stop.store(true, Ordering::SeqCst);
    client.join().unwrap();
    assert_eq!(
        failed.load(Ordering::SeqCst),
        0,
        "requests failed during the upgrade"
    );
    assert!(served.load(Ordering::SeqCst) > 10);
    // What the manual says the journal shows.
    let log = journal();
    assert!(
        log.contains("upgrade: the new gateway serves; draining"),
        "{log}"
    );
    assert!(
        log.contains("state dir: the old gateway let go; this one owns it now"),
        "{log}"
    );
    // The new process serves, and continues the buckets (the state dir's file).
    assert_eq!(readyz(admin)["status"], "ready");
    assert_eq!(decisions(admin, "203.0.113.7", 1), [429]);

    // A reload with an invalid policy fails and changes nothing.
    std::fs::write(&policy, r#"{"rules": [{"name": "x"}]}"#).unwrap();
    let status = command("ExecReload").status().expect("ExecReload");
    assert!(
        !status.success(),
        "a reload with an invalid policy succeeded"
    );
    assert_eq!(owner(), Some(new_pid));
    assert_eq!(readyz(admin)["status"], "ready");

    // systemctl stop: SIGTERM drains and exits 0.
    // SAFETY: kill(2) on a process this test started.
    unsafe {
        libc::kill(new_pid, libc::SIGTERM);
    }
    assert_eq!(
        wait_pid(new_pid, Duration::from_secs(30)),
        0,
        "{}",
        journal()
    );
    reaper.0.clear();
}

/// The Deployment's `--upstream` is resolved once, at start: a name that does not resolve (its
/// Service not created yet) stops the container with exit 1 and the message the "Deploying"
/// page quotes, which is what makes the pod crash-loop until the Service exists. The manifest's
/// arguments are used as written, the host moved under `.invalid` (which never resolves).
#[test]
fn the_deployments_upstream_must_resolve_at_start_as_the_page_says() {
    let base = yaml_docs("deploy/kubernetes/deployment.yaml");
    let container = deployment_container(&base);
    let mut args = strings(&container["args"]);
    let at = args
        .iter()
        .position(|a| a == "--upstream")
        .expect("--upstream");
    assert_eq!(args[at + 1], "backend:8080", "the page names backend:8080");
    args[at + 1] = "backend.invalid:8080".to_string();
    let tmp = tempfile::tempdir().expect("tmp");
    let policy = tmp.path().join("policy.json");
    std::fs::write(&policy, read("policies/axum-per-ip.json")).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("run")
        .args(&args)
        .env("TOLLGATE_POLICY", &policy)
        .env("TOLLGATE_LISTEN", format!("127.0.0.1:{}", free_port()))
        .env(
            "TOLLGATE_ADMIN_LISTEN",
            format!("127.0.0.1:{}", free_port()),
        )
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let _reaper = Reaper(vec![child.id()]);
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(Instant::now() < deadline, "still running after 30 s");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(1), "{stderr}");
    let said = "invalid configuration:\n  --upstream \"backend.invalid:8080\": expected a resolvable HOST:PORT";
    assert!(stderr.contains(said), "{stderr}");
    let page = read("docs/src/operations/deploying.md");
    assert!(
        page.contains(&format!(
            "```text\n{}\n```",
            said.replace("backend.invalid", "backend")
        )),
        "deploying.md no longer quotes what the pod prints"
    );
    // The remedy the page gives: the API's Service before the Deployment. kustomize's default
    // (legacy) order puts Services first, which the base must not switch off.
    let kustomization: Value =
        serde_yaml_ng::from_str(&read("deploy/kubernetes/kustomization.yaml")).unwrap();
    assert!(
        kustomization.get("sortOptions").is_none(),
        "sortOptions would change the order the page relies on"
    );
}

/// The block of `deploying.md` that `scripts/image.sh` writes, as (label, value) rows.
fn image_facts(page: &str) -> Vec<(String, String)> {
    let begin = "<!-- image-facts -->\n";
    assert_eq!(page.matches(begin).count(), 1, "one image-facts block");
    let start = page.find(begin).unwrap() + begin.len();
    let stop = start
        + page[start..]
            .find("<!-- /image-facts -->")
            .expect("its end");
    page[start..stop]
        .lines()
        .skip(2)
        .map(|line| {
            let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
            assert_eq!(cells.len(), 2, "{line}");
            (cells[0].to_string(), cells[1].to_string())
        })
        .collect()
}

const IMAGE_ROWS: [&str; 4] = [
    "the image",
    "its base (glibc, libgcc, CA certificates)",
    "a first run (`debootstrap` builds the base)",
    "a later run (the base cached)",
];

/// The image's size and build time on the "Deploying" page are what `scripts/image.sh` wrote
/// (its `--write-facts` step, run here on a copy of the page): each run rewrites the sizes and
/// its own kind of run's time and keeps the other's; the page shows no size outside that block.
#[test]
fn the_image_figures_on_the_page_are_written_by_image_sh() {
    let page = read("docs/src/operations/deploying.md");
    let rows = image_facts(&page);
    let labels: Vec<&str> = rows.iter().map(|(l, _)| l.as_str()).collect();
    assert_eq!(labels, IMAGE_ROWS);
    // Outside the block, sizes and times of the image are placeholders, never figures.
    let begin = page.find("<!-- image-facts -->").unwrap();
    let end = page.find("<!-- /image-facts -->").unwrap();
    let outside = format!("{}{}", &page[..begin], &page[end..]);
    for line in outside.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        for pair in words.windows(2) {
            assert!(
                !(pair[1].starts_with("MiB") && pair[0].chars().all(|c| c.is_ascii_digit())),
                "a typed image size in deploying.md: {line}"
            );
        }
    }

    let tmp = tempfile::tempdir().expect("tmp");
    let copy = tmp.path().join("deploying.md");
    std::fs::write(&copy, &page).unwrap();
    let write = |args: &[&str]| {
        Command::new("bash")
            .arg(root().join("scripts/image.sh"))
            .arg("--write-facts")
            .arg(&copy)
            .args(args)
            .output()
            .expect("bash")
    };
    let out = write(&["31457280", "4194304", "65", "first"]);
    assert!(out.status.success(), "{out:?}");
    let first = image_facts(&std::fs::read_to_string(&copy).unwrap());
    assert_eq!(first[0].1, "30 MiB (31 457 280 bytes)");
    assert_eq!(first[1].1, "4 MiB");
    assert!(first[2].1.starts_with("65 s, measured "), "{first:?}");
    assert_eq!(first[3], rows[3], "the later run's row is kept");
    let out = write(&["30039152", "4194304", "7", "later"]);
    assert!(out.status.success(), "{out:?}");
    let later = std::fs::read_to_string(&copy).unwrap();
    let second = image_facts(&later);
    assert_eq!(second[0].1, "28 MiB (30 039 152 bytes)");
    assert_eq!(second[2], first[2], "the first run's row is kept");
    assert!(second[3].1.starts_with("7 s, measured "), "{second:?}");
    // Only the block changed.
    let block = |text: &str| {
        let a = text.find("<!-- image-facts -->").unwrap();
        let b = text.find("<!-- /image-facts -->").unwrap();
        format!("{}{}", &text[..a], &text[b..])
    };
    assert_eq!(block(&later), block(&page));
    // A page without the block, or a wrong kind of run, fails.
    std::fs::write(&copy, "no block here\n").unwrap();
    assert!(!write(&["1", "1", "1", "first"]).status.success());
    std::fs::write(&copy, &page).unwrap();
    assert!(!write(&["1", "1", "1", "sometimes"]).status.success());
}
