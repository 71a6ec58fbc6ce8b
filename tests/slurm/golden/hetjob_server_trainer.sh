#!/bin/bash
# hpcrl heterogeneous job: server (component 0), trainer (component 1)
#SBATCH --job-name=hpcrl-server
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=90
#SBATCH --gpus-per-node=8
#SBATCH --mem=64G
#SBATCH --partition=batch
#SBATCH --account=rl-team
#SBATCH --qos=high
#SBATCH --constraint=h100
#SBATCH --comment='hpcrl run'
#SBATCH --output='/shared/runs/it'"'"'s a "quoted" run $HOME 100%%/exp/trial/slurm/%j_batch.out'
#SBATCH --error='/shared/runs/it'"'"'s a "quoted" run $HOME 100%%/exp/trial/slurm/%j_batch.err'
#SBATCH --open-mode=append
#SBATCH hetjob
#SBATCH --job-name=hpcrl-trainer
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --time=120
#SBATCH --gpus-per-node=8
#SBATCH --mem=1536M
#SBATCH --partition=train
#SBATCH --account=rl-team
#SBATCH --qos=high
#SBATCH --constraint=h100
#SBATCH --comment='hpcrl run'
#SBATCH --exclusive

# setup
module load cuda/12.4
source /shared/venv/bin/activate

folder='/shared/runs/it'"'"'s a "quoted" run $HOME 100%/exp/trial/slurm'
logs='/shared/runs/it'"'"'s a "quoted" run $HOME 100%%/exp/trial/slurm'
roles=(server trainer)

# component 0: server
(
  export SGLANG_LOG='a b'
  exec srun --het-group=0 --unbuffered --nodes=1 --ntasks=4 --ntasks-per-node=4 --cpus-per-task=8 --kill-on-bad-exit=1 --output "$logs/${SLURM_JOB_ID}+0_%t_log.out" --error "$logs/${SLURM_JOB_ID}+0_%t_log.err" /shared/venv/bin/python -u -m hpcrl.launch.slurm '/shared/runs/it'"'"'s a "quoted" run $HOME 100%/exp/trial/slurm/0123_server.pkl' 2>>"$folder/${SLURM_JOB_ID}+0_srun.err"
) &
pids[0]=$!

# component 1: trainer
(
  exec srun --het-group=1 --unbuffered --nodes=2 --ntasks=2 --ntasks-per-node=1 --cpus-per-task=8 --kill-on-bad-exit=1 --output "$logs/${SLURM_JOB_ID}+1_%t_log.out" --error "$logs/${SLURM_JOB_ID}+1_%t_log.err" /shared/venv/bin/python -u -m hpcrl.launch.slurm '/shared/runs/it'"'"'s a "quoted" run $HOME 100%/exp/trial/slurm/0123_trainer.pkl' 2>>"$folder/${SLURM_JOB_ID}+1_srun.err"
) &
pids[1]=$!

# the roles share one fate: when one component's step ends, the job ends and Slurm stops the others
wait -n
status=$?
# the one that ended: its process is gone, the others run until this script exits (bash 4.3's wait -n
# does not say which)
first=? role=?
for k in "${!pids[@]}"; do kill -0 "${pids[$k]}" 2>/dev/null || { first=$k role=${roles[$k]}; break; }; done
echo "$first" > "$folder/${SLURM_JOB_ID}_ended_first"
echo "hpcrl: the step of component $first ($role) ended first, with status $status; ending the heterogeneous job" >&2
exit $status
