//! The `tollgate` binary: parse the command line, dispatch, map results to exit codes.

use clap::Parser;
use std::process::ExitCode;
use tollgate::config::cli::{self, Cli, Command};
use tollgate::fleet::commands as fleet;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let stdout = std::io::stdout();
    let stderr = std::io::stderr();
    let code = match cli.command {
        Command::Validate(args) => cli::validate(&args, &mut stdout.lock(), &mut stderr.lock()),
        Command::Simulate(args) => cli::simulate(&args, &mut stdout.lock(), &mut stderr.lock()),
        Command::Import(command) => cli::import(&command, &mut stdout.lock(), &mut stderr.lock()),
        Command::Publish(args) => fleet::publish(&args, &mut stdout.lock(), &mut stderr.lock()),
        Command::Promote(args) => fleet::promote(&args, &mut stdout.lock(), &mut stderr.lock()),
        Command::Rollback(args) => fleet::rollback(&args, &mut stdout.lock(), &mut stderr.lock()),
        Command::Refresh(args) => fleet::refresh(&args, &mut stdout.lock(), &mut stderr.lock()),
        Command::Repair(args) => fleet::repair(&args, &mut stdout.lock(), &mut stderr.lock()),
        Command::Fleet(args) => fleet::fleet(&args, &mut stdout.lock(), &mut stderr.lock()),
        Command::Run(args) => tollgate::proxy::run(*args),
    };
    ExitCode::from(code)
}
