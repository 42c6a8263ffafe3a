//! The manual's walkthrough pages, run as a reader would run them: every shell block of a page,
//! in order, in one bash session, against the binary cargo built for this test and real peers
//! (Python's `http.server`, nginx, Envoy, Redis), with the outputs the page shows compared to what the
//! commands print. A page whose commands stop working, or whose shown output no longer matches,
//! fails here.
//!
//! # How a page marks its blocks (renders as ordinary code in mdBook)
//!
//! - ```` ```sh ```` (or ```` ```bash ````): run, in page order, in ONE `bash` session with
//!   `set -euo pipefail`, so variables, the working directory and background processes persist
//!   from block to block. A command that fails stops the page.
//! - ```` ```sh,norun ````: shown, checked by `tests/docs.rs`, never run. For the steps this
//!   test does itself before a page starts: building (`cargo build --release` and putting
//!   `target/release` on `PATH`) is replaced by a directory first on `PATH` holding a `tollgate`
//!   symlink to the binary cargo built for this test (`CARGO_BIN_EXE_tollgate`); installing
//!   packages (`bash scripts/install-deps.sh`, `apt-get install nginx-light`) is replaced by what
//!   `scripts/test.sh` installs before it runs the tests; installing Envoy into
//!   `target/envoy-venv` (done by `scripts/test.sh` through `scripts/install-envoy.sh`) and
//!   linking it onto `PATH` is replaced by an `envoy` symlink in that same directory, to the
//!   binary `tests/envoy.rs` uses (`TOLLGATE_ENVOY`, else the one under `target/envoy-venv`);
//!   installing grpcio into `target/grpc-venv` (`scripts/install-grpc-python.sh`, run by
//!   `scripts/test.sh`) and putting it on `PATH` is replaced by a `python` wrapper there that
//!   runs that virtualenv's python.
//! - `<!-- output -->` (an HTML comment: mdBook shows nothing) on its own line, then a
//!   ```` ```text ```` block: the standard output of the nearest `sh` block above it (prose may
//!   stand between them, another shell block may not), compared line by line (trailing white
//!   space and `\r` ignored, trailing empty lines ignored). A line `...` matches any run of
//!   lines, none included; `…` (U+2026) inside a line matches any text within that line (times,
//!   ports, process ids, hashes). A `text` block without the comment is only shown.
//!
//! # Where a page runs
//!
//! In a fresh temporary directory holding a symlink to each top-level entry of the repository
//! (`policies`, `examples`, `scripts`...; not `target` nor dot files): paths read like those of
//! a fresh clone, and whatever a page writes (state directories, logs, an nginx prefix) goes to
//! the temporary directory, never into the repository. Pages must not write through those
//! symlinks. The session runs in a process group of its own, bounded by [`PAGE_TIMEOUT`]; when
//! it ends, however it ends, the whole group is sent SIGTERM then SIGKILL, so a page's
//! background `tollgate run ... &` (or nginx started with `daemon off;`) never outlives it.
//! Proxy variables are cleared, `TOLLGATE_*` and `RUST_LOG` too, so the environment cannot
//! change what a page does.
//!
//! # Ports
//!
//! Pages use the manual's usual loopback ports: 3000 for the test upstream, 8080 for the proxy,
//! 9090 for the admin listener, 8000 for nginx; 8081 and 9091 for a second gateway or tollgate's
//! gRPC listener, 10000 for Envoy, 6379 for Redis. No other test binds them (the others take ports
//! from 20000 up, see `tests/support`), cargo runs test binaries one at a time, and the pages
//! of this file run one at a time (a lock): a port busy anyway fails the page, naming it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long one page may run, all its blocks together.
const PAGE_TIMEOUT: Duration = Duration::from_secs(60);

/// The loopback ports the walkthroughs use (see the module comment).
const PAGE_PORTS: [u16; 8] = [3000, 6379, 8000, 8080, 8081, 9090, 9091, 10000];

/// Pages run one at a time: they share the ports.
static ONE_PAGE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The python of the virtualenv `scripts/install-grpc-python.sh` made (grpcio and
/// grpcio-status), which the gRPC page runs as `python`.
fn grpc_python() -> Option<PathBuf> {
    let python = root().join("target/grpc-venv/bin/python");
    python.is_file().then_some(python)
}

/// The Envoy binary, found as `tests/envoy.rs` finds it: `TOLLGATE_ENVOY`, else the one
/// `scripts/install-envoy.sh` installed under `target/envoy-venv`.
fn envoy_binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("TOLLGATE_ENVOY") {
        // scripts/test.sh sets it relative to the repository (`target/envoy-venv/...`); the
        // symlink on the pages' PATH lives elsewhere, so it must point at an absolute path.
        return Some(root().join(path));
    }
    let lib = root().join("target/envoy-venv/lib");
    std::fs::read_dir(lib)
        .ok()?
        .flatten()
        .map(|python| python.path().join("site-packages/envoy/_bin/envoy"))
        .find(|candidate| candidate.is_file())
}

/// One fenced shell block of a page.
#[derive(Debug, Clone, PartialEq)]
struct Block {
    /// 1-based line of the opening fence in the page.
    line: usize,
    text: String,
    /// Run, or only shown (`sh,norun`).
    run: bool,
    /// The output the page shows for it (`<!-- output -->` + `text` block).
    expected: Option<String>,
}

/// The shell blocks of a page, in order, with the outputs attached to them.
fn parse(page: &str) -> Result<Vec<Block>, String> {
    let mut blocks: Vec<Block> = Vec::new();
    let mut lines = page.lines().enumerate();
    let mut output_marked: Option<usize> = None;
    while let Some((n, line)) = lines.next() {
        let trimmed = line.trim();
        if trimmed == "<!-- output -->" {
            output_marked = Some(n + 1);
            continue;
        }
        let Some(info) = trimmed.strip_prefix("```") else {
            continue;
        };
        let mut parts = info.split(',').map(str::trim);
        let lang = parts.next().unwrap_or("");
        let attrs: Vec<&str> = parts.collect();
        let mut body = String::new();
        let mut closed = false;
        for (_, line) in lines.by_ref() {
            if line.trim_start().starts_with("```") {
                closed = true;
                break;
            }
            body.push_str(line);
            body.push('\n');
        }
        if !closed {
            return Err(format!("line {}: a code block never closed", n + 1));
        }
        match (lang, output_marked.take()) {
            ("text", Some(_)) => {
                let Some(last) = blocks.last_mut() else {
                    return Err(format!(
                        "line {}: an output block with no shell block before it",
                        n + 1
                    ));
                };
                if !last.run {
                    return Err(format!(
                        "line {}: an output block after a block that is not run (line {})",
                        n + 1,
                        last.line
                    ));
                }
                if last.expected.is_some() {
                    return Err(format!(
                        "line {}: a second output block for the shell block of line {}",
                        n + 1,
                        last.line
                    ));
                }
                last.expected = Some(body);
            }
            (_, Some(marked)) => {
                return Err(format!(
                    "line {marked}: `<!-- output -->` must be followed by a ```text block"
                ))
            }
            ("sh" | "bash", None) => blocks.push(Block {
                line: n + 1,
                text: body,
                run: !attrs.contains(&"norun"),
                expected: None,
            }),
            _ => {}
        }
    }
    if let Some(marked) = output_marked {
        return Err(format!(
            "line {marked}: `<!-- output -->` with no block after it"
        ));
    }
    Ok(blocks)
}

/// Does one line of output match one line of a page's expected output (`…` = any text)?
fn line_matches(expected: &str, actual: &str) -> bool {
    let pieces: Vec<&str> = expected.split('…').collect();
    if pieces.len() == 1 {
        return expected == actual;
    }
    let (first, rest) = pieces
        .split_first()
        .expect("split gives one piece at least");
    let (last, middle) = rest.split_last().expect("two pieces at least");
    let Some(mut remaining) = actual.strip_prefix(first) else {
        return false;
    };
    for piece in middle {
        match remaining.find(piece) {
            Some(at) => remaining = &remaining[at + piece.len()..],
            None => return false,
        }
    }
    remaining.len() >= last.len() && remaining.ends_with(last)
}

/// Lines as compared: `\r` and trailing white space dropped, trailing empty lines dropped.
fn normalised(text: &str) -> Vec<String> {
    let mut lines: Vec<String> = text.lines().map(|l| l.trim_end().to_string()).collect();
    while lines.last().is_some_and(String::is_empty) {
        lines.pop();
    }
    lines
}

/// Does the whole output match (`...` lines = any run of lines)?
fn output_matches(expected: &[String], actual: &[String]) -> bool {
    match expected.split_first() {
        None => actual.is_empty(),
        Some((first, rest)) if first == "..." => {
            (0..=actual.len()).any(|skip| output_matches(rest, &actual[skip..]))
        }
        Some((first, rest)) => actual
            .split_first()
            .is_some_and(|(a, more)| line_matches(first, a) && output_matches(rest, more)),
    }
}

/// A line diff of expected against actual (`-` only expected, `+` only printed, ` ` both),
/// `...` lines left out and `…` lines matched as patterns.
fn diff(expected: &[String], actual: &[String]) -> String {
    let expected: Vec<&String> = expected.iter().filter(|l| *l != "...").collect();
    let (n, m) = (expected.len(), actual.len());
    // Longest common subsequence, table from the end.
    let mut lcs = vec![vec![0usize; m + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            lcs[i][j] = if line_matches(expected[i], &actual[j]) {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    let (mut i, mut j) = (0, 0);
    let mut out = String::new();
    while i < n || j < m {
        if i < n && j < m && line_matches(expected[i], &actual[j]) {
            out.push_str(&format!("  {}\n", actual[j]));
            i += 1;
            j += 1;
        } else if j < m && (i == n || lcs[i][j + 1] >= lcs[i + 1][j]) {
            out.push_str(&format!("+ {}\n", actual[j]));
            j += 1;
        } else {
            out.push_str(&format!("- {}\n", expected[i]));
            i += 1;
        }
    }
    out
}

/// The bash script of a page: each block run in the session's own shell (a `{ }` group, not a
/// subshell), its standard output and error kept per block, the running block's number written
/// down first so a failure can be placed.
fn script(blocks: &[Block], runner: &Path) -> String {
    let mut out = String::from("set -euo pipefail\n");
    let runner = runner.display();
    for (k, block) in blocks.iter().enumerate().filter(|(_, b)| b.run) {
        out.push_str(&format!("echo {k} > '{runner}/current'\n{{\n"));
        out.push_str(&block.text);
        out.push_str(&format!(
            "\n}} > '{runner}/{k}.out' 2> '{runner}/{k}.err'\n"
        ));
    }
    out.push_str(&format!("echo done > '{runner}/current'\n"));
    out
}

/// Signals a whole process group; false when nothing is left in it.
fn signal_group(pgid: i32, signal: i32) -> bool {
    // SAFETY: kill(2) with a negative pid signals our own child's process group; no memory is
    // involved.
    unsafe { libc::kill(-pgid, signal) == 0 }
}

/// The last lines of each `*.log` file a page wrote in its directory (a background process's
/// log tells why a later block failed).
fn page_logs(work: &Path) -> String {
    let mut out = String::new();
    let Ok(entries) = std::fs::read_dir(work) else {
        return out;
    };
    let mut logs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "log") && p.is_file())
        .collect();
    logs.sort();
    for log in logs {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = &lines[lines.len().saturating_sub(30)..];
        out.push_str(&format!(
            "--- {} (last {} lines)\n{}\n",
            log.file_name().unwrap_or_default().to_string_lossy(),
            tail.len(),
            tail.join("\n")
        ));
    }
    out
}

/// Runs a page's blocks (see the module comment) and answers how many outputs were compared;
/// the error says which block failed or which output differs, with the block, what it printed
/// and the diff.
fn run_page(name: &str, page: &str) -> Result<usize, String> {
    let blocks = parse(page).map_err(|e| format!("{name}: {e}"))?;
    if !blocks.iter().any(|b| b.run) {
        return Err(format!("{name}: no shell block to run"));
    }
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let work = dir.path().join("work");
    let runner = dir.path().join("runner");
    let bin = dir.path().join("bin");
    for d in [&work, &runner, &bin] {
        std::fs::create_dir(d).map_err(|e| e.to_string())?;
    }
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_tollgate"), bin.join("tollgate"))
        .map_err(|e| e.to_string())?;
    if let Some(envoy) = envoy_binary() {
        std::os::unix::fs::symlink(envoy, bin.join("envoy")).map_err(|e| e.to_string())?;
    }
    if let Some(python) = grpc_python() {
        // A wrapper, not a symlink: a virtualenv's python finds its packages from the path it
        // is started by.
        let wrapper = bin.join("python");
        std::fs::write(
            &wrapper,
            format!("#!/bin/sh\nexec '{}' \"$@\"\n", python.display()),
        )
        .map_err(|e| e.to_string())?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| e.to_string())?;
    }
    for entry in std::fs::read_dir(root()).map_err(|e| e.to_string())? {
        let entry = entry.map_err(|e| e.to_string())?;
        let file_name = entry.file_name();
        let name = file_name.to_string_lossy();
        if name.starts_with('.') || name == "target" {
            continue;
        }
        std::os::unix::fs::symlink(entry.path(), work.join(&*file_name))
            .map_err(|e| e.to_string())?;
    }
    let script_path = runner.join("page.sh");
    std::fs::write(&script_path, script(&blocks, &runner)).map_err(|e| e.to_string())?;
    let path = format!(
        "{}:{}:/usr/sbin:/sbin",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut command = Command::new("bash");
    command
        .arg(&script_path)
        .current_dir(&work)
        .env("PATH", path)
        .env("no_proxy", "127.0.0.1,localhost,::1")
        .env("NO_PROXY", "127.0.0.1,localhost,::1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (key, _) in std::env::vars_os() {
        let key_text = key.to_string_lossy();
        if key_text.starts_with("TOLLGATE_")
            || key_text == "RUST_LOG"
            || key_text.to_ascii_lowercase().ends_with("_proxy")
        {
            command.env_remove(&key);
        }
    }
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    let mut child = command.spawn().map_err(|e| format!("{name}: bash: {e}"))?;
    let pgid = child.id() as i32;
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if started.elapsed() > PAGE_TIMEOUT => break None,
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("{name}: waiting for bash: {e}")),
        }
    };
    // Whatever the page left running: asked to stop, then stopped.
    let logs = page_logs(&work);
    if signal_group(pgid, libc::SIGTERM) {
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline && signal_group(pgid, 0) {
            let _ = child.try_wait();
            std::thread::sleep(Duration::from_millis(20));
        }
        if signal_group(pgid, libc::SIGKILL) {
            // Gone before the next page binds the same ports.
            let deadline = Instant::now() + Duration::from_secs(2);
            while Instant::now() < deadline && signal_group(pgid, 0) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
    let _ = child.wait();
    let mut session_stderr = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut pipe, &mut session_stderr);
    }
    let current = std::fs::read_to_string(runner.join("current")).unwrap_or_default();
    let read = |k: usize, ext: &str| {
        std::fs::read_to_string(runner.join(format!("{k}.{ext}"))).unwrap_or_default()
    };
    let describe = |k: usize| {
        let block = &blocks[k];
        format!(
            "{name}, the block at line {}:\n{}\n--- its standard output\n{}\n--- its standard error\n{}",
            block.line,
            block.text.trim_end(),
            read(k, "out").trim_end(),
            read(k, "err").trim_end()
        )
    };
    if current.trim() != "done" || status.is_none_or(|s| !s.success()) {
        let failed: Option<usize> = current.trim().parse().ok();
        let why = match status {
            None => format!("timed out after {PAGE_TIMEOUT:?}"),
            Some(status) => format!("stopped ({status})"),
        };
        let ports_busy: Vec<u16> = PAGE_PORTS
            .iter()
            .copied()
            .filter(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_err())
            .collect();
        return Err(format!(
            "{why}\n{}\n--- the session\n{}\n{}{}",
            failed.map_or("before the first block".to_string(), describe),
            session_stderr.trim_end(),
            logs,
            if ports_busy.is_empty() {
                String::new()
            } else {
                format!("(ports still busy after the page: {ports_busy:?})\n")
            }
        ));
    }
    let mut differences = Vec::new();
    for (k, block) in blocks.iter().enumerate() {
        let Some(expected) = &block.expected else {
            continue;
        };
        let expected = normalised(expected);
        let actual = normalised(&read(k, "out"));
        if !output_matches(&expected, &actual) {
            differences.push(format!(
                "{}\n--- diff (- the page, + printed)\n{}",
                describe(k),
                diff(&expected, &actual)
            ));
        }
    }
    if differences.is_empty() {
        Ok(blocks.iter().filter(|b| b.expected.is_some()).count())
    } else {
        Err(format!(
            "the output differs from what the page shows:\n{}",
            differences.join("\n\n")
        ))
    }
}

/// Runs one page of the manual, ports free first.
fn walk(page: &str) {
    let _one = ONE_PAGE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    for port in PAGE_PORTS {
        assert!(
            std::net::TcpListener::bind(("127.0.0.1", port)).is_ok(),
            "port {port} is in use by something else: the walkthroughs need it"
        );
    }
    let text = std::fs::read_to_string(root().join("docs/src").join(page))
        .unwrap_or_else(|e| panic!("{page}: {e}"));
    match run_page(page, &text) {
        // A walkthrough shows the reader what to expect: a page whose output blocks stopped
        // being recognised would otherwise pass on its commands alone.
        Ok(compared) => assert!(
            compared >= 5,
            "{page}: only {compared} outputs compared: are they marked `<!-- output -->`?"
        ),
        Err(e) => panic!("{page}: {e}"),
    }
}

#[test]
fn walkthrough_reverse_proxy() {
    walk("getting-started/reverse-proxy.md");
}

#[test]
fn walkthrough_decision_service_behind_nginx() {
    walk("getting-started/decision-service.md");
}

#[test]
fn walkthrough_migration_from_fairvisor() {
    walk("migration/fairvisor.md");
}

#[test]
fn walkthrough_migration_from_nginx_limit_req() {
    walk("migration/nginx.md");
}

#[test]
fn walkthrough_llm_gateway() {
    walk("getting-started/llm-gateway.md");
}

#[test]
fn walkthrough_tenants() {
    walk("getting-started/tenants.md");
}

#[test]
fn walkthrough_llm_budgets() {
    walk("getting-started/llm-budgets.md");
}

#[test]
fn walkthrough_login() {
    walk("getting-started/login.md");
}

#[test]
fn walkthrough_operator() {
    walk("operations/operator.md");
}

// The runner itself can fail: a failing command, a wrong output and a left-over background
// process are each caught.

fn lines(text: &str) -> Vec<String> {
    normalised(text)
}

#[test]
fn the_output_patterns_match_what_they_say() {
    assert!(line_matches("pid …", "pid 4242"));
    assert!(line_matches("pid …", "pid "));
    assert!(!line_matches("pid …", "pi 4242"));
    assert!(line_matches("a…b…c", "a-x-b-y-c"));
    assert!(!line_matches("a…b…c", "a-x-c-y-b"));
    assert!(!line_matches("ab…ba", "aba"));
    assert!(line_matches("exact", "exact"));
    assert!(!line_matches("exact", "exactly"));
    assert!(output_matches(&lines("a\n...\nd"), &lines("a\nb\nc\nd")));
    assert!(output_matches(&lines("a\n...\nd"), &lines("a\nd")));
    assert!(output_matches(&lines("...\n"), &lines("anything\nat all")));
    assert!(!output_matches(&lines("a\n...\nd"), &lines("a\nb\nc")));
    assert!(!output_matches(&lines("a\nb"), &lines("a\nb\nc")));
    assert!(output_matches(&lines("a  \r\nb\n\n"), &lines("a\nb")));
    assert_eq!(
        diff(&lines("a\nb\nc"), &lines("a\nx\nc")),
        "  a\n+ x\n- b\n  c\n"
    );
}

#[test]
fn the_page_markings_parse_as_documented() {
    let page = "Intro\n\n```sh\necho one\n```\n\nprose\n\n<!-- output -->\n```text\none\n```\n\n\
                ```sh,norun\ncargo build --release\n```\n\n```text\nshown only\n```\n\n\
                ```bash\necho two\n```\n";
    let blocks = parse(page).unwrap();
    assert_eq!(blocks.len(), 3);
    assert_eq!(blocks[0].expected.as_deref(), Some("one\n"));
    assert!(blocks[0].run);
    assert!(!blocks[1].run);
    assert_eq!(blocks[1].expected, None);
    assert!(blocks[2].run && blocks[2].text == "echo two\n");
    assert!(parse("```sh,norun\nx\n```\n<!-- output -->\n```text\nx\n```\n").is_err());
    assert!(parse("```sh\nx\n```\n<!-- output -->\n```sh\nx\n```\n").is_err());
    assert!(parse("```sh\nx\n").is_err());
}

#[test]
fn a_failing_command_or_a_different_output_fails_the_page() {
    let failing =
        "```sh\nx=1\necho before\n```\n\n```sh\necho \"x is $x\"\nfalse\necho never\n```\n";
    let err = run_page("failing.md", failing).unwrap_err();
    assert!(err.contains("the block at line 6"), "{err}");
    assert!(err.contains("x is 1"), "variables persist: {err}");
    assert!(
        err.contains("--- its standard output\nx is 1\n--- its standard error"),
        "the page stops at the failing command: {err}"
    );
    let differs = "```sh\nprintf 'a\\nb\\n'\n```\n<!-- output -->\n```text\na\nc\n```\n";
    let err = run_page("differs.md", differs).unwrap_err();
    assert!(err.contains("- c\n") && err.contains("+ b\n"), "{err}");
    let fine = "```sh\nprintf 'a\\nb\\nc\\n'\necho \"$(pwd)\" > where\n```\n<!-- output -->\n```text\na\n...\n```\n\
                ```sh\ntest -e policies && test ! -e target && tollgate --version >/dev/null\n```\n";
    assert_eq!(run_page("fine.md", fine), Ok(1));
}

#[test]
fn background_processes_of_a_page_are_stopped_at_its_end() {
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("pid");
    let page = format!(
        "```sh\nsleep 300 &\necho $! > '{}'\n```\n",
        pid_file.display()
    );
    assert_eq!(run_page("background.md", &page), Ok(0));
    let pid: i32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // Signalled and gone: kill(pid, 0) fails (or finds a zombie about to be reaped by init, not
    // one still sleeping).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let gone = state.is_empty() || state.contains(") Z ");
        if gone {
            break;
        }
        assert!(Instant::now() < deadline, "sleep {pid} still runs: {state}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn walkthrough_envoy() {
    assert!(
        envoy_binary().is_some(),
        "Envoy is not installed: run `bash scripts/test.sh` (it runs scripts/install-envoy.sh)"
    );
    walk("getting-started/envoy.md");
}

#[test]
fn walkthrough_grpc() {
    assert!(
        grpc_python().is_some(),
        "grpcio is not installed: run `bash scripts/test.sh` (it runs scripts/install-grpc-python.sh)"
    );
    walk("getting-started/grpc.md");
}

#[test]
fn walkthrough_fleet() {
    walk("getting-started/fleet.md");
}
