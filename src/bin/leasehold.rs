//! `leasehold`: the operator CLI (cargo feature `cli`). Everything is in
//! `leasehold::cli`; run `leasehold --help` for the commands.

fn main() -> std::process::ExitCode {
    leasehold::cli::main()
}
