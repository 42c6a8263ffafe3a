//! The manual (`docs/src`, an mdBook) and the README, read as a newcomer would follow them:
//! every relative link leads to a file that exists and every `#anchor` to a heading of it (as
//! mdBook names headings), every page is in the book's `SUMMARY.md`, and every command shown —
//! in a `sh` block or as inline code — is one that works: `tollgate` invocations parse with the
//! real command line (flags exist, values are valid), the files they name exist, scripts,
//! benches and examples exist, and the endpoints `curl` is pointed at are served.

use crate::support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use clap::Parser;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every page of the manual, and the README.
fn pages() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("docs/src") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    let mut out = vec![root().join("README.md")];
    walk(&root().join("docs/src"), &mut out);
    out.sort();
    out
}

/// The text of a page outside fenced code blocks, line by line (code blocks hold neither links
/// nor headings).
fn prose(text: &str) -> Vec<&str> {
    let mut inside = false;
    text.lines()
        .filter(|line| {
            if line.starts_with("```") {
                inside = !inside;
                return false;
            }
            !inside
        })
        .collect()
}

/// A heading's anchor as mdBook makes it: lower case, letters, digits, `_` and `-` kept,
/// whitespace as `-`, everything else dropped.
fn anchor(heading: &str) -> String {
    heading
        .chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '_' || c == '-' {
                Some(c.to_lowercase().next().unwrap_or(c))
            } else if c.is_whitespace() {
                Some('-')
            } else {
                None
            }
        })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    prose(text)
        .into_iter()
        .filter_map(|line| {
            let hashes = line.chars().take_while(|&c| c == '#').count();
            (hashes > 0 && line[hashes..].starts_with(' ')).then(|| anchor(line[hashes..].trim()))
        })
        .collect()
}

/// `[text](target)` links of a line, outside inline code.
fn links(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_code = false;
    let bytes = line.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'`' => in_code = !in_code,
            b']' if !in_code && bytes.get(i + 1) == Some(&b'(') => {
                if let Some(end) = line[i + 2..].find(')') {
                    out.push(line[i + 2..i + 2 + end].to_string());
                    i += 2 + end;
                }
            }
            _ => {}
        }
        i += 1;
    }
    out
}

#[test]
fn every_link_and_anchor_of_the_manual_resolves() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("page");
        for line in prose(&text) {
            for target in links(line) {
                if target.starts_with("http://") || target.starts_with("https://") {
                    continue;
                }
                checked += 1;
                let (file, fragment) = match target.split_once('#') {
                    Some((file, fragment)) => (file, Some(fragment)),
                    None => (target.as_str(), None),
                };
                let resolved = if file.is_empty() {
                    page.clone()
                } else {
                    page.parent().expect("dir").join(file)
                };
                if !resolved.exists() {
                    broken.push(format!("{}: {target} (no such file)", page.display()));
                    continue;
                }
                if let Some(fragment) = fragment {
                    let target_text = std::fs::read_to_string(&resolved).unwrap_or_default();
                    if !anchors(&target_text).contains(fragment) {
                        broken.push(format!("{}: {target} (no such heading)", page.display()));
                    }
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(
        checked > 40,
        "only {checked} links found: is the parser right?"
    );
}

#[test]
fn every_page_is_in_the_book() {
    let src = root().join("docs/src");
    let summary = std::fs::read_to_string(src.join("SUMMARY.md")).expect("SUMMARY.md");
    let listed: BTreeSet<PathBuf> = prose(&summary)
        .into_iter()
        .flat_map(links)
        .map(|l| src.join(l))
        .collect();
    for page in pages() {
        if page.starts_with(&src) && !page.ends_with("SUMMARY.md") {
            assert!(
                listed.contains(&page),
                "{} is not in SUMMARY.md",
                page.display()
            );
        }
    }
    for listed in &listed {
        assert!(listed.exists(), "SUMMARY.md lists {}", listed.display());
    }
}

/// A merge left half-done (conflict markers committed) shows two versions of a page at once.
#[test]
fn no_page_carries_merge_conflict_markers() {
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("page");
        for (n, line) in text.lines().enumerate() {
            assert!(
                !(line.starts_with("<<<<<<< ")
                    || line.starts_with(">>>>>>> ")
                    || line == "======="),
                "{}:{}: a merge conflict marker",
                page.display(),
                n + 1
            );
        }
    }
}

/// The commands a page shows: each line of a `sh` block (continuation lines joined, `&&`
/// chains split), and inline code that starts with a command this project ships (read per
/// paragraph: a span may wrap onto the next line).
fn commands(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut inside: Option<String> = None;
    let mut pending = String::new();
    let mut paragraph = String::new();
    let shipped = ["tollgate ", "cargo ", "bash scripts/", "bash benches/"];
    let inline = |paragraph: &mut String, out: &mut Vec<String>| {
        for (k, span) in paragraph.split('`').enumerate() {
            if k % 2 == 1 && shipped.iter().any(|p| span.starts_with(p)) {
                out.push(span.to_string());
            }
        }
        paragraph.clear();
    };
    for line in text.lines() {
        if inside.is_none() && (line.trim().is_empty() || line.starts_with("```")) {
            inline(&mut paragraph, &mut out);
        }
        if let Some(lang) = line.strip_prefix("```") {
            inside = match inside {
                Some(_) => None,
                // `sh,norun` (shown, not run by tests/walkthroughs.rs) is still a `sh` block.
                None => Some(lang.split(',').next().unwrap_or("").trim().to_string()),
            };
            continue;
        }
        match inside.as_deref() {
            Some("sh" | "bash" | "console") => {
                let line = line.trim().trim_start_matches("$ ");
                if let Some(head) = line.strip_suffix('\\') {
                    pending.push_str(head);
                    pending.push(' ');
                    continue;
                }
                pending.push_str(line);
                let full = std::mem::take(&mut pending);
                out.extend(
                    full.split("&&")
                        .map(|c| c.trim().to_string())
                        .filter(|c| !c.is_empty() && !c.starts_with('#')),
                );
            }
            Some(_) => {}
            None => {
                paragraph.push_str(line.trim());
                paragraph.push(' ');
            }
        }
    }
    inline(&mut paragraph, &mut out);
    out
}

thread_local! {
    /// `tollgate` command lines parsed by [`check_command`] on this thread.
    static PARSED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// What is wrong with one command, if anything.
fn check_command(command: &str, admin_paths: &str) -> Result<(), String> {
    let mut words = support::shell_words(command);
    // What a shell does with the output is not the command's.
    if let Some(at) = words.iter().position(|w| {
        matches!(
            w.as_str(),
            ">" | ">>" | "|" | "<" | "2>" | ";" | "2>&1" | "&"
        )
    }) {
        words.truncate(at);
    }
    // Environment assignments in front (`TOLLGATE_JWT_SECRET=... cargo run ...`).
    while words.first().is_some_and(|w| {
        w.split_once('=').is_some_and(|(k, _)| {
            !k.is_empty() && k.chars().all(|c| c.is_ascii_uppercase() || c == '_')
        })
    }) {
        words.remove(0);
    }
    let Some(first) = words.first().cloned() else {
        return Ok(());
    };
    let exists = |path: &str| {
        // A glob (`policies/*.json`) names a directory that must exist.
        let path = path.split('*').next().unwrap_or(path);
        root().join(path).exists()
    };
    let tollgate_args = match first.as_str() {
        "tollgate" | "./target/release/tollgate" | "target/release/tollgate" => Some(&words[1..]),
        "cargo" if words.get(1).map(String::as_str) == Some("run") => {
            match words.iter().position(|w| w == "--example") {
                Some(at) => {
                    let example = words.get(at + 1).ok_or("--example without a name")?;
                    return exists(&format!("examples/{example}.rs"))
                        .then_some(())
                        .ok_or(format!("no example {example}"));
                }
                None => words
                    .iter()
                    .position(|w| w == "--")
                    .map(|at| &words[at + 1..]),
            }
        }
        "cargo" => {
            if let Some(at) = words.iter().position(|w| w == "--test") {
                // The integration tests are one binary; a filter `module::` names a file of it.
                let test = words.get(at + 1).ok_or("--test without a name")?;
                if test != "integration" {
                    return Err(format!(
                        "no test binary {test}: the integration tests are `--test integration`"
                    ));
                }
                let filter = words.get(at + 2).filter(|w| !w.starts_with('-'));
                if let Some((module, _)) = filter.and_then(|f| f.split_once("::")) {
                    return exists(&format!("tests/{module}.rs"))
                        .then_some(())
                        .ok_or(format!("no test module {module}"));
                }
                return Ok(());
            }
            if let Some(at) = words.iter().position(|w| w == "--bench") {
                let bench = words.get(at + 1).ok_or("--bench without a name")?;
                return exists(&format!("benches/{bench}.rs"))
                    .then_some(())
                    .ok_or(format!("no bench {bench}"));
            }
            return Ok(());
        }
        "bash" | "python3" => {
            let script = words.get(1).ok_or("no script")?;
            // `python3 -m http.server`: a module of Python's own; `python3 - <<'EOF'` and
            // `python3 -c '...'`: a program shown in the page itself.
            if words[0] == "python3" && matches!(script.as_str(), "-m" | "-" | "-c") {
                return Ok(());
            }
            return exists(script)
                .then_some(())
                .ok_or(format!("no script {script}"));
        }
        "curl" => {
            // A path on the admin listener (port 9090 by default) must be a route it serves,
            // as written in its router; the proxy's paths are the upstream's.
            let Some(url) = words.iter().find(|w| w.contains(":9090")) else {
                return Ok(());
            };
            let path = url
                .split_once("://")
                .map_or(url.as_str(), |(_, rest)| rest)
                .split_once('/')
                .map_or("", |(_, p)| p);
            let segments: Vec<&str> = path.split(['?', '/']).collect();
            let take = if segments.first() == Some(&"v1") {
                2
            } else {
                1
            };
            let route = format!("/{}", segments[..take.min(segments.len())].join("/"));
            return admin_paths
                .contains(&format!("\"{route}\""))
                .then_some(())
                .ok_or(format!("no route {route} in the admin router"));
        }
        _ => return Ok(()),
    };
    let Some(args) = tollgate_args else {
        return Ok(());
    };
    // Placeholders a reader fills in stand for a value: `<file>` becomes one, `[--flag X]` is
    // read as `--flag X`, `a|b` as its first choice, a trailing `...` (more of the same) dropped.
    if args.first().map(String::as_str) == Some("help") {
        return Ok(());
    }
    let args: Vec<String> = args
        .iter()
        .map(|a| {
            a.trim_end_matches("...")
                .trim_start_matches('[')
                .trim_end_matches(']')
        })
        .filter(|a| !a.is_empty())
        .map(|a| {
            if a.starts_with('<') && a.ends_with('>') {
                "1".to_string()
            } else {
                a.split('|').next().unwrap_or(a).to_string()
            }
        })
        .collect();
    // A file of this repository a command names (a policy, an example, a fixture) must exist;
    // the reader's own files (`bundle.json`, `/etc/...`) cannot be checked.
    for arg in &args {
        let repo_file = ["policies/", "examples/", "monitoring/", "tests/fixtures/"]
            .iter()
            .any(|p| arg.starts_with(p));
        if repo_file && !exists(arg) {
            return Err(format!("{arg} does not exist"));
        }
    }
    PARSED.with(|n| n.set(n.get() + 1));
    let argv = std::iter::once("tollgate".to_string()).chain(args.iter().cloned());
    match tollgate::config::cli::Cli::try_parse_from(argv) {
        Ok(_) => Ok(()),
        Err(e) => {
            use clap::error::ErrorKind as K;
            match e.kind() {
                // A command shown without its required arguments (`tollgate import envoy-ratelimit`
                // named in a sentence) still has every flag right.
                K::MissingRequiredArgument
                | K::MissingSubcommand
                | K::DisplayHelp
                | K::DisplayHelpOnMissingArgumentOrSubcommand
                | K::DisplayVersion => Ok(()),
                _ => Err(e.to_string()),
            }
        }
    }
}

/// Synopsis blocks (untagged, a `tollgate <command>` line and its indented continuation lines):
/// every `--flag` they name is one that command has.
fn synopsis_flags(text: &str) -> Vec<String> {
    use clap::CommandFactory;
    let cli = tollgate::config::cli::Cli::command();
    let mut out = Vec::new();
    let mut untagged = false;
    let mut inside = false;
    let mut current: Option<String> = None;
    for line in text.lines() {
        if let Some(lang) = line.strip_prefix("```") {
            inside = !inside;
            untagged = inside && lang.trim().is_empty();
            current = None;
            continue;
        }
        if !(inside && untagged) {
            continue;
        }
        if let Some(rest) = line.strip_prefix("tollgate ") {
            current = rest.split_whitespace().next().map(str::to_string);
        } else if !line.starts_with(char::is_whitespace) {
            current = None;
        }
        let Some(name) = current.as_deref() else {
            continue;
        };
        let Some(command) = cli.find_subcommand(name) else {
            out.push(format!("no command `tollgate {name}`"));
            continue;
        };
        let longs: BTreeSet<&str> = command
            .get_arguments()
            .filter_map(|a| a.get_long())
            .collect();
        for word in line.split(|c: char| c.is_whitespace() || "[]|".contains(c)) {
            if let Some(flag) = word.strip_prefix("--") {
                let flag = flag.trim_end_matches("...");
                if !longs.contains(flag) {
                    out.push(format!("`tollgate {name}` has no --{flag}"));
                }
            }
        }
    }
    out
}

#[test]
fn every_command_shown_works() {
    // The files that hold the admin listener's route literals (a moved file fails here, not
    // silently as an empty text).
    let admin_paths = [
        "src/proxy/admin.rs",
        "src/operator/mod.rs",
        "src/operator/endpoints.rs",
    ]
    .iter()
    .map(|p| std::fs::read_to_string(root().join(p)).unwrap_or_else(|e| panic!("{p}: {e}")))
    .collect::<Vec<_>>()
    .join("\n");
    let mut failures = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("page");
        for command in commands(&text) {
            if let Err(why) = check_command(&command, &admin_paths) {
                failures.push(format!("{}: `{command}`: {why}", page.display()));
            }
        }
        failures.extend(
            synopsis_flags(&text)
                .into_iter()
                .map(|why| format!("{}: {why}", page.display())),
        );
    }
    assert!(
        failures.is_empty(),
        "commands that do not work:\n{}",
        failures.join("\n\n")
    );
    let parsed = PARSED.with(std::cell::Cell::get);
    assert!(
        parsed > 15,
        "only {parsed} tollgate commands parsed: is the reader right?"
    );
}

/// The checks themselves can fail: a flag that does not exist, a value that does not parse, a
/// missing policy file, a missing script or test module and a broken anchor are each caught.
#[test]
fn the_checks_catch_what_they_are_for() {
    let admin = "\"/v1/buckets\"";
    assert!(check_command(
        "tollgate run --policy policies/axum-per-ip.json --threads 2",
        admin
    )
    .is_ok());
    assert!(check_command("tollgate run --no-such-flag", admin).is_err());
    assert!(check_command("tollgate run --threads lots", admin).is_err());
    assert!(check_command("tollgate validate policies/no-such.json", admin).is_err());
    assert!(check_command("bash scripts/no-such.sh", admin).is_err());
    assert!(check_command("python3 no-such.py", admin).is_err());
    assert!(check_command("python3 - bundle.json > shadow.json <<'EOF'", admin).is_ok());
    assert!(check_command("cargo bench --bench no_such", admin).is_err());
    assert!(check_command("cargo test --test integration gateway::", admin).is_ok());
    assert!(check_command("cargo test --test integration no_such::x", admin).is_err());
    assert!(check_command("cargo test --test gateway", admin).is_err());
    assert!(check_command("curl -s localhost:9090/v1/buckets/x", admin).is_ok());
    assert!(check_command("curl -s localhost:9090/v1/nothing", admin).is_err());
    assert!(check_command("curl -s localhost:8080/v1/orders", admin).is_ok());
    assert!(check_command("tollgate import envoy-ratelimit x.yaml > edge.json", admin).is_ok());
    assert!(check_command("tollgate run --policy <file> --bogus", admin).is_err());
    assert!(check_command("tollgate run --policy F [--threads many]", admin).is_err());
    assert!(check_command("curl -s localhost:9090/v1/bucket/x", admin).is_err());
    assert_eq!(
        synopsis_flags("```\ntollgate run --policy FILE\n    [--no-such X]\n```\n"),
        ["`tollgate run` has no --no-such"]
    );
    assert!(synopsis_flags("```\ntollgate run --policy FILE [--threads 2]\n```\n").is_empty());
    assert_eq!(
        anchor("The client's network: `ip:country`"),
        "the-clients-network-ipcountry"
    );
    assert_eq!(links("see [a](b.md#c) and `[x](y)`"), ["b.md#c"]);
    assert_eq!(
        support::shell_words(r#"H="Authorization: Bearer $T" curl"#),
        ["H=Authorization: Bearer $T", "curl"]
    );
}

/// The `src/…` paths a text names (a file, or a folder with its trailing `/`), outside links.
fn source_paths(text: &str) -> Vec<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = text[from..].find("src/").map(|i| from + i) {
        from = at + 4;
        let before = at.checked_sub(1).map(|i| bytes[i]);
        if before.is_some_and(|b| b.is_ascii_alphanumeric() || b == b'/' || b == b'_' || b == b'.')
        {
            continue;
        }
        let end = text[at..]
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || "_/.".contains(c)))
            .map_or(text.len(), |i| at + i);
        let path = text[at..end].trim_end_matches('.');
        if path.len() > 4 {
            out.push(path.to_string());
        }
    }
    out
}

#[test]
fn every_source_path_the_manual_names_exists() {
    let mut missing = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("page");
        for path in source_paths(&text) {
            checked += 1;
            if !root().join(&path).exists() {
                missing.push(format!("{}: {path}", page.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "no such source path:\n{}",
        missing.join("\n")
    );
    assert!(
        checked > 30,
        "only {checked} source paths found: is the scan right?"
    );
    assert_eq!(
        source_paths("see `src/engine/mod.rs`, src/proxy/ and docs/src/x.md; src/a.rs."),
        ["src/engine/mod.rs", "src/proxy/", "src/a.rs"]
    );
}
