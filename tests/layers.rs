//! The source's shape, as `docs/src/development.md` ("Layout") promises it: no two files import
//! each other around a circle and no import climbs a layer of the map in `src/lib.rs` except the
//! listed exceptions (both counted by `scripts/import-circles.py`, which is tested here on small
//! crates it must find circles and climbs in), `src/` is the dozen entries that map names, and no
//! function outside tests runs over 150 lines (`scripts/fn-lengths.py`, tested the same way).

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs the circle count with `--check` over `src`: (passed, its output).
fn count_circles(src: &Path) -> (bool, String) {
    let out = Command::new("python3")
        .arg(root().join("scripts/import-circles.py"))
        .arg("--check")
        .arg(src)
        .output()
        .expect("python3 runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// A small crate: `files` as (path under src/, text).
fn crate_of(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    for (path, text) in files {
        let path = dir.path().join("src").join(path);
        std::fs::create_dir_all(path.parent().expect("parent")).expect("dirs");
        std::fs::write(path, text).expect("write");
    }
    dir
}

#[test]
fn no_source_file_is_in_an_import_circle() {
    let (passed, out) = count_circles(&root().join("src"));
    assert!(passed, "import circles in src/:\n{out}");
    let summary = out.lines().next().unwrap_or_default();
    assert!(
        summary.ends_with(", 0 circle(s)"),
        "unexpected summary: {summary}"
    );
    // The count reads the real tree: over a hundred files and their edges.
    let files: usize = summary
        .split(' ')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(files > 100, "only {files} files counted: {summary}");
    assert!(
        out.contains("\n0 upward import(s), 1 listed exception(s)\n"),
        "{out}"
    );
}

/// A map with a one-layer folder at each end and a ranged folder between them.
const MAP: &str = "//! ```text\n//! low/   L0  bottom\n//! mid/   L0-L1  either\n//! high/  L2  top\n//! ```\npub mod low;\npub mod mid;\npub mod high;\n";

#[test]
fn the_layer_check_finds_an_import_that_climbs() {
    // Downward imports only: high uses mid, mid uses low.
    let down = crate_of(&[
        ("lib.rs", MAP),
        ("low/mod.rs", "pub struct L;\n"),
        (
            "mid/mod.rs",
            "pub fn m() -> crate::low::L { crate::low::L }\n",
        ),
        (
            "high/mod.rs",
            "pub fn h() -> crate::low::L { crate::mid::m() }\n",
        ),
    ]);
    let (passed, out) = count_circles(&down.path().join("src"));
    assert!(passed, "{out}");
    assert!(
        out.contains("\n0 upward import(s), 0 listed exception(s)"),
        "{out}"
    );

    // The bottom folder naming the top one climbs two layers.
    let up = crate_of(&[
        ("lib.rs", MAP),
        (
            "low/mod.rs",
            "pub struct L;\npub fn l() { crate::high::h() }\n",
        ),
        ("mid/mod.rs", "pub struct M;\n"),
        ("high/mod.rs", "pub fn h() {}\n"),
    ]);
    let (passed, out) = count_circles(&up.path().join("src"));
    assert!(!passed);
    assert!(
        out.contains("\n1 upward import(s), 0 listed exception(s)\nclimbs a layer: low/mod.rs (L0) -> high/mod.rs (L2)\n"),
        "{out}"
    );

    // A ranged folder's file takes the layer of what it imports: mid naming high puts it at L2,
    // over its folder's top (L1).
    let over = crate_of(&[
        ("lib.rs", MAP),
        ("low/mod.rs", "pub struct L;\n"),
        ("mid/mod.rs", "pub fn m() { crate::high::h() }\n"),
        ("high/mod.rs", "pub fn h() {}\n"),
    ]);
    let (passed, out) = count_circles(&over.path().join("src"));
    assert!(!passed);
    assert!(
        out.contains(
            "climbs a layer: mid/mod.rs is L2, over its folder's L1: imports high/mod.rs\n"
        ),
        "{out}"
    );
}

/// Runs the function-length count over `src` with `--max 150`: (passed, its output).
fn measure_functions(src: &Path) -> (bool, String) {
    let out = Command::new("python3")
        .arg(root().join("scripts/fn-lengths.py"))
        .args(["--max", "150", "--top", "3"])
        .arg(src)
        .output()
        .expect("python3 runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn no_function_outside_tests_runs_over_150_lines() {
    let (passed, out) = measure_functions(&root().join("src"));
    assert!(passed, "{out}");
}

#[test]
fn the_length_count_reads_bodies_not_braces_in_text() {
    // 153 lines from `fn long` to its brace; a brace in a string, a char and a comment does not
    // end it early; a test module's function is not counted; a trait method without a body is
    // skipped.
    let body = "    let _ = 1;\n".repeat(148);
    let text = format!(
        "pub trait T {{ fn bare(&self); }}\npub fn long() {{\n    let _ = \"}}\";\n    let _ = '}}';\n    // }}\n{body}}}\n#[cfg(test)]\nmod tests {{\n    fn in_test() {{\n{body}{body}    }}\n}}\npub fn short() {{}}\n"
    );
    let long = crate_of(&[("lib.rs", &text)]);
    let (passed, out) = measure_functions(&long.path().join("src"));
    assert!(!passed);
    assert!(
        out.starts_with(
            "2 functions; longest 153 lines\n  153  long  src/lib.rs:2\n    1  short  src/lib.rs:"
        ),
        "{out}"
    );
    assert!(out.ends_with("1 function(s) over 150 lines\n"), "{out}");
}

#[test]
fn the_circle_count_finds_each_way_of_closing_a_circle() {
    // Two files importing each other with `use`.
    let used = crate_of(&[
        ("lib.rs", "pub mod a;\npub mod b;\n"),
        (
            "a.rs",
            "use crate::b::B;\npub struct A(pub Option<Box<B>>);\n",
        ),
        (
            "b.rs",
            "use crate::a::A;\npub struct B(pub Option<Box<A>>);\n",
        ),
    ]);
    let (passed, out) = count_circles(&used.path().join("src"));
    assert!(!passed);
    assert!(
        out.starts_with("3 files, 2 import edges, 1 circle(s)\n"),
        "{out}"
    );
    assert!(
        out.contains("circle of 2 files: src/a.rs, src/b.rs"),
        "{out}"
    );

    // A child naming its parent's item while the parent names the child's, through paths in
    // code (no `use`); test code is left out.
    let nested = crate_of(&[
        ("lib.rs", "pub mod m;\n"),
        (
            "m/mod.rs",
            "pub mod child;\npub struct Parent;\npub fn f() -> child::Child { child::Child }\n",
        ),
        (
            "m/child.rs",
            "pub struct Child;\npub fn g() -> super::Parent { super::Parent }\n",
        ),
    ]);
    let (passed, out) = count_circles(&nested.path().join("src"));
    assert!(!passed);
    assert!(
        out.contains("circle of 2 files: src/m/child.rs, src/m/mod.rs"),
        "{out}"
    );

    // The same child importing from a sibling instead: no circle; a test module's imports
    // and a comment's path do not count.
    let fixed = crate_of(&[
        ("lib.rs", "pub mod m;\n"),
        (
            "m/mod.rs",
            "pub mod child;\npub mod parent;\npub fn f() -> child::Child { child::Child }\n",
        ),
        ("m/parent.rs", "pub struct Parent;\n"),
        (
            "m/child.rs",
            "// super::f() is not called\npub struct Child;\npub fn g() -> super::parent::Parent { super::parent::Parent }\n#[cfg(test)]\nmod tests {\n    use super::super::f;\n}\n",
        ),
    ]);
    let (passed, out) = count_circles(&fixed.path().join("src"));
    assert!(passed, "{out}");
    assert!(
        out.starts_with("4 files, 2 import edges, 0 circle(s)"),
        "{out}"
    );
}

#[test]
fn src_lists_the_folders_the_crate_map_names() {
    let mut entries: Vec<String> = std::fs::read_dir(root().join("src"))
        .expect("src")
        .map(|e| {
            let e = e.expect("entry");
            let name = e.file_name().to_string_lossy().into_owned();
            if e.path().is_dir() {
                format!("{name}/")
            } else {
                name
            }
        })
        .collect();
    entries.sort();
    assert!(
        entries.len() <= 13,
        "src/ lists {}: {entries:?}",
        entries.len()
    );
    let map = std::fs::read_to_string(root().join("src/lib.rs")).expect("lib.rs");
    let layout =
        std::fs::read_to_string(root().join("docs/src/development.md")).expect("development.md");
    for entry in entries.iter().filter(|e| e.ends_with('/')) {
        assert!(
            map.lines().any(|l| l.starts_with(&format!("//! {entry} "))),
            "src/lib.rs's map does not name {entry}"
        );
        assert!(
            layout.contains(&format!("\nsrc/{entry} ")),
            "development.md's Layout does not list src/{entry}"
        );
    }
}
