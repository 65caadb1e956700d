//! The same lock-step training run (no late ranks, blocking group averaging) gives the same
//! model bit for bit over threads (`mem`), local processes (`tcp`) and, when built with the
//! `mpi` feature, `mpirun` (`mpi`).

mod common;
#[cfg(feature = "mpi")]
use common::mpirun;
use common::{ok, tmp, wagma};

use std::path::Path;
use std::process::Command;

/// `wagma train` options of the run, without the transport.
fn train_args(out: &Path) -> Vec<String> {
    let mut v: Vec<String> = [
        "train",
        "--algo",
        "wagma",
        "--blocking",
        "true",
        "--group-size",
        "2",
        "--tau",
        "3",
        "--steps",
        "12",
        "--eval-every",
        "12",
        "--seed",
        "11",
        "--dataset",
        "builtin",
        "--quiet",
        "true",
        "--out",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.push(out.display().to_string());
    v
}

fn run(cmd: &mut Command) {
    ok(&cmd.output().unwrap());
}

fn model(out: &Path) -> Vec<u8> {
    std::fs::read(out.join("final-model.bin")).unwrap()
}

fn over_mem(ranks: usize) -> Vec<u8> {
    let out = tmp("mem");
    let mut args = train_args(&out);
    args.extend(["--ranks".into(), ranks.to_string()]);
    run(wagma().args(&args));
    let m = model(&out);
    let _ = std::fs::remove_dir_all(&out);
    m
}

#[test]
fn lockstep_training_gives_identical_models_over_mem_and_tcp() {
    let ranks = 4;
    let mem = over_mem(ranks);
    let out = tmp("tcp");
    let mut args: Vec<String> = ["launch", "-n", "4", "--timeout", "300", "--", "wagma"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(train_args(&out));
    args.extend(["--transport".into(), "tcp".into()]);
    run(wagma().args(&args));
    let tcp = model(&out);
    let _ = std::fs::remove_dir_all(&out);
    assert!(!mem.is_empty());
    assert!(mem == tcp, "the models over mem and tcp differ");
}

#[cfg(feature = "mpi")]
#[test]
fn lockstep_training_gives_identical_models_over_mem_and_mpi() {
    let ranks = 4;
    let mem = over_mem(ranks);
    let out = tmp("mpi");
    let mut cmd = mpirun(4);
    cmd.args(train_args(&out)).args(["--transport", "mpi"]);
    run(&mut cmd);
    let mpi = model(&out);
    let _ = std::fs::remove_dir_all(&out);
    assert!(mem == mpi, "the models over mem and mpi differ");
}
