//! The same lock-step training run (no late ranks, blocking group averaging) gives the same
//! model bit for bit over threads (`mem`), local processes (`tcp`) and, when built with the
//! `mpi` feature, `mpirun` (`mpi`).

mod common;
#[cfg(feature = "mpi")]
use common::mpirun;
use common::{ok, tmp, wagma};

use std::path::Path;
use std::process::Command;

/// The algorithms compared: WAGMA with blocking group averaging, and D-PSGD with the
/// authors' blocking right-then-left sends (empty rendezvous messages) in chained pieces.
const ALGOS: [&[&str]; 2] = [
    &[
        "--algo",
        "wagma",
        "--blocking",
        "true",
        "--group-size",
        "2",
        "--tau",
        "3",
    ],
    &[
        "--algo",
        "d-psgd",
        "--send-order",
        "right-then-left",
        "--exchange-pieces",
        "3",
    ],
];

/// `wagma train` options of the run of `algo`, without the transport. The CNN is wide enough
/// (442K parameters) that a pair's parts are large enough for TCP to fold them as they arrive.
fn train_args(algo: &[&str], out: &Path) -> Vec<String> {
    let mut v: Vec<String> = ["train"]
        .iter()
        .chain(algo)
        .chain(&[
            "--width",
            "64",
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
        ])
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

fn over_mem(algo: &[&str], ranks: usize) -> Vec<u8> {
    let out = tmp("mem");
    let mut args = train_args(algo, &out);
    args.extend(["--ranks".into(), ranks.to_string()]);
    run(wagma().args(&args));
    let m = model(&out);
    let _ = std::fs::remove_dir_all(&out);
    m
}

#[test]
fn lockstep_training_gives_identical_models_over_mem_and_tcp() {
    for algo in ALGOS {
        let mem = over_mem(algo, 4);
        let out = tmp("tcp");
        let mut args: Vec<String> = ["launch", "-n", "4", "--timeout", "300", "--", "wagma"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        args.extend(train_args(algo, &out));
        args.extend(["--transport".into(), "tcp".into()]);
        run(wagma().args(&args));
        let tcp = model(&out);
        let _ = std::fs::remove_dir_all(&out);
        assert!(!mem.is_empty());
        assert!(mem == tcp, "{algo:?}: the models over mem and tcp differ");
    }
}

#[cfg(feature = "mpi")]
#[test]
fn lockstep_training_gives_identical_models_over_mem_and_mpi() {
    for algo in ALGOS {
        let mem = over_mem(algo, 4);
        let out = tmp("mpi");
        let mut cmd = mpirun(4);
        cmd.args(train_args(algo, &out))
            .args(["--transport", "mpi"]);
        run(&mut cmd);
        let mpi = model(&out);
        let _ = std::fs::remove_dir_all(&out);
        assert!(mem == mpi, "{algo:?}: the models over mem and mpi differ");
    }
}
